"""One small file of the output's store written only if absent, or only if unchanged since it
was read: the compare-and-swap the output lease (`raypipe.commit.lease`) stands on.

On S3 the store's own conditions do it (`If-None-Match: *` to create, `If-Match` on the ETag
to replace); on a local path, the same checks under an `flock` of `<file>.lock`. A conditional
write whose answer was lost (S3 carried the PUT out and the client's retry found the object
changed, by us) counts as done when the stored bytes are the ones we wrote: every body written
through here is unique (the lease's records carry a token and an instant).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import uuid
from collections.abc import Iterator

from raypipe.errors import OutputPermissionError, SinkError, UnsafeOutputError
from raypipe.store import OutputStore

__all__ = ["ConditionalFile", "check_conditional_writes"]


class ConditionalFile:
    """The file at `path` of `store` (`what` names it in errors): `read` gives its bytes and a
    version tag (the ETag on S3, the content locally); `create` and `replace` write it on a
    condition and say whether they did."""

    def __init__(self, store: OutputStore, path: str, what: str) -> None:
        self.store = store
        self.path = path
        self.what = what

    def read(self) -> tuple[bytes | None, str | None]:
        """The file's bytes and version tag; (None, None) when there is no file."""
        try:
            raw = self.store.read_bytes(self.path)
            tag = raw.decode() if self.store.is_local else self.store.fs.info(self.path).get("ETag")
        except FileNotFoundError:
            return None, None
        except PermissionError as e:
            raise OutputPermissionError(f"cannot read {self.what}: {e}", path=self.store.full_uri(self.path)) from e
        return raw, tag

    @contextlib.contextmanager
    def local_lock(self) -> Iterator[None]:
        """Locally, the file's `flock` (the conditions are checked under it); on S3, nothing."""
        if not self.store.is_local:
            yield
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path + ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def create(self, body: bytes) -> bool:
        """Writes `body` if there is no file; False if there is one (not ours)."""
        if self.store.is_local:
            with self.local_lock():
                if os.path.exists(self.path):
                    return False
                with self._unless_landed(body):
                    self.store.write_bytes(self.path, body)
            return True
        try:
            with self._unless_landed(body):
                self.store.fs.pipe_file(self.path, body, mode="create")
        except FileExistsError:
            return self.landed(body)
        except PermissionError as e:
            raise OutputPermissionError(
                f"no permission to write {self.what} ({e}); check the credentials' access to the output",
                path=self.store.full_uri(self.path),
            ) from e
        return True

    def replace(self, tag: str | None, body: bytes) -> bool:
        """Writes `body` only if the file is still the version `tag`; False if it changed."""
        if self.store.is_local:
            with self.local_lock():
                _, now_tag = self.read()
                if now_tag != tag:
                    return False
                with self._unless_landed(body):
                    self.store.write_bytes(self.path, body)
            return True
        bucket, _, key = self.path.partition("/")
        try:
            self.store.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, IfMatch=tag)
        except PermissionError as e:
            where = self.store.full_uri(self.path)
            raise OutputPermissionError(f"no permission to write {self.what} ({e})", path=where) from e
        except OSError as e:
            if e.errno == errno.EINVAL or isinstance(e, FileExistsError | FileNotFoundError):
                return self.landed(body)  # 412 Precondition Failed: somebody else changed it first, or we did
            if self.landed(body):  # carried out, its answer lost past the client's retries
                return True
            raise SinkError(f"cannot write {self.what}: {e}", path=self.store.full_uri(self.path)) from e
        self.store.fs.invalidate_cache(self.path)
        return True

    def landed(self, body: bytes) -> bool:
        """Is the stored file `body`, though the write of it was refused or failed?

        S3 may carry a PUT out and lose the answer; the client's retry then finds the object
        changed (by us) and fails its condition. The stored bytes say whether the write was ours."""
        self.store.fs.invalidate_cache(self.path)
        try:
            return self.store.read_bytes(self.path) == body
        except FileNotFoundError:
            return False

    @contextlib.contextmanager
    def _unless_landed(self, body: bytes) -> Iterator[None]:
        """A write that failed with its outcome unknown (the store carried it out and the answer was
        lost, past the client's own retries) counts as done when the stored file is `body`."""
        try:
            yield
        except (FileExistsError, PermissionError):
            raise
        except (OSError, SinkError):
            if not self.landed(body):
                raise


def check_conditional_writes(store: OutputStore) -> None:
    """Refuses an S3 endpoint that ignores `If-None-Match` (no conditional write could exclude
    anyone) with `UnsafeOutputError`; a local store checks its conditions itself."""
    if store.is_local:
        return
    probe = store.state(f".conditional-write-probe-{uuid.uuid4().hex[:8]}")
    try:
        # The probe's name is new: if this create is refused, its answer was lost and a retry found it.
        with contextlib.suppress(FileExistsError):
            store.fs.pipe_file(probe, b"1", mode="create")
        try:
            store.fs.pipe_file(probe, b"2", mode="create")
        except FileExistsError:
            return
        raise UnsafeOutputError(
            f"the object store behind {store.uri} ignores conditional writes (If-None-Match), so raypipe "
            "cannot keep two attempts from writing at once; use an endpoint that supports them (AWS S3 does), "
            "or set output.require_conditional_writes=false to accept the risk"
        )
    except PermissionError as e:
        raise OutputPermissionError(f"no permission to write under the output ({e})", path=store.full_uri(probe)) from e
    finally:
        store.delete(probe)
