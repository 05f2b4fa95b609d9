"""Bring your own model: export a fine-tuned checkpoint to a served model directory, and check one.

    raypipe model export --from-hf DIR OUT               # a local Hugging Face checkpoint
    raypipe model export --from-savedmodel DIR OUT --labels a,b,c --tokenizer DIR
    raypipe model check DIR

Both exports write the layout `serve_app.model` documents (``model.json`` + ``saved_model/`` +
``tokenizer/``) through `save_serving_model`, the one place the serving signature is defined
(the demo model is saved through it too). The card records where the model came from, its
labels, max length, vocabulary and parameter count; its version is a prefix plus a SHA-256 of
everything in the directory that changes an answer (`_common.answers_digest`): the served
weights, the tokenizer's files, the max length and the labels in their order. The same weights
exported from PyTorch or TF files with the same tokenizer, length and labels get the same
version; retrained weights, another tokenizer, ``--max-length`` or ``--labels`` a new one.
Directories exported before the version covered more than the weights keep the version their
card states (answers already committed under it stay reusable with that directory).

An export fails before it writes anything the server would reject: the directory is built
beside ``OUT``, loaded back through `EmotionModel` (the server's loader), checked at its limits
(`serve_app.model.check_model_limits`), compared with the source model on a few sentences, and
only then renamed into place.

Nothing here touches the network. Sources must be local directories (a Hub model id is an
error that says so), and every transformers loader runs with ``local_files_only``. PyTorch
weights are read from safetensors with numpy and converted to TF by transformers, so torch is
not needed. Errors are `ExportError` (a `ModelDirError`: the path at fault and the problem).

Modules: `signature` (the served signature, saved once for every origin) · `hf` (Hugging Face
checkpoints) · `savedmodel` (TF SavedModels, adapted) · `check` (``model check``) ·
`_common` (the steps both exports share). Import from here; the rest is internal.
"""

from serve_app.export._common import ExportError
from serve_app.export.check import SAMPLE_TEXTS, ModelCheck, check_model_dir
from serve_app.export.hf import SUPPORTED_MODEL_TYPES, export_hf_checkpoint
from serve_app.export.savedmodel import OutputKind, export_saved_model
from serve_app.export.signature import save_hf_classifier, save_serving_model

__all__ = [
    "SAMPLE_TEXTS",
    "SUPPORTED_MODEL_TYPES",
    "ExportError",
    "ModelCheck",
    "OutputKind",
    "check_model_dir",
    "export_hf_checkpoint",
    "export_saved_model",
    "save_hf_classifier",
    "save_serving_model",
]
