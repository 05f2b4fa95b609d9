"""Every Ray task and actor raypipe starts fits in what the default replica leaves on a node.

`raypipe serve` with no sizing flag gives its one replica every CPU of the node but
`serve_app.deploy.RESERVED_CPUS`. A task or actor that asks for more than what is left is never
scheduled, and the driver waits for it forever (a daily once hung in `ray.get` on index tasks
that asked for a whole CPU). So this reads every place in `raypipe/` that starts Ray work
(`ray.remote`, `.options`, Ray Data reads and `map_batches`) and checks the CPUs each asks for,
and what one run holds at once, against that rest on nodes of 1 to 16 CPUs. A new launch site
that asks for a whole CPU, or that asks for nothing (Ray's default: one CPU), fails here.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from raypipe.config import ActorPoolConfig, default_max_actors
from serve_app.deploy import fit_replicas

PACKAGE = Path(__file__).parents[2] / "raypipe"

#: Node sizes (CPUs) a default replica is fitted to. From 32 CPUs the default actor pool grows
#: past one actor (`raypipe.config.CPUS_PER_ACTOR`); see `test_one_run_fits_beside_the_default_replica`.
NODE_CPUS = (1, 2, 4, 8, 16)

#: Dataset methods that start Ray work (each takes `num_cpus`; without it, one CPU), besides every
#: `ray.data.read_*` (pyarrow's `read_json`, `read_table`, ... run in the calling process). Not
#: `Dataset.map`/`filter`, whose names pyarrow and the standard library share: raypipe uses
#: neither on a dataset; a site added with them needs its name here.
DATA_LAUNCHERS = frozenset({"map_batches", "flat_map"})

#: Values read from settings rather than written at the call: checked at their defaults (a user
#: who raises them sizes the cluster for it).
SETTINGS = {"actors.num_cpus": ActorPoolConfig().num_cpus}

#: Launch sites known today: the scan must find at least these (a scan finding nothing passes nothing).
KNOWN = {
    ("call/reuse/scan.py", "_split"),
    ("call/reuse/scan.py", "_merge_fresh"),
    ("run/pipeline.py", "read_datasource"),
    ("run/pipeline.py", "map_batches"),
    ("run/cost.py", "sweep_node"),
}


def free_cpus(node_cpus: float) -> float:
    """What a default replica leaves on a node of `node_cpus`."""
    replicas, each = fit_replicas(node_cpus)
    return node_cpus - replicas * each


@dataclass(frozen=True)
class Launch:
    module: str
    what: str
    line: int
    num_cpus: float

    def __str__(self) -> str:
        return f"raypipe/{self.module}:{self.line} ({self.what}) asks for {self.num_cpus:g} CPU"


def _is_ray_remote(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "remote" and _name(node.value) == "ray"


def _on_ray_remote(options: ast.Call) -> bool:
    """`ray.remote(...)...options(...)`: counted with its `ray.remote`."""
    node: ast.AST = options
    while isinstance(node, ast.Call):
        if _is_ray_remote(node.func) or (isinstance(node.func, ast.Call) and _is_ray_remote(node.func.func)):
            return True
        node = node.func.value if isinstance(node.func, ast.Attribute) else node.func
    return False


def _name(node: ast.AST) -> str:
    return ast.unparse(node)


def _cpus(module: str, node: ast.expr) -> float:
    """The value of a `num_cpus=` argument: a literal, a module constant, or a known setting."""
    try:
        return float(ast.literal_eval(node))
    except ValueError:
        pass
    text = _name(node)
    if text in SETTINGS:
        return float(SETTINGS[text])
    if isinstance(node, ast.Name):
        mod = importlib.import_module("raypipe." + module.removesuffix(".py").replace("/", "."))
        return float(getattr(mod, node.id))
    raise AssertionError(f"raypipe/{module}: num_cpus={text} is neither a constant nor in SETTINGS")


def _num_cpus(module: str, *calls: ast.Call) -> float | None:
    for call in calls:
        for kw in call.keywords:
            if kw.arg == "num_cpus":
                return _cpus(module, kw.value)
    return None


def launches() -> list[Launch]:
    """Every place under `raypipe/` that starts a Ray task or actor, with the CPUs it asks for
    (one when it names none: Ray's default for tasks, and for an actor's scheduling)."""
    found: list[Launch] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

        def chained_options(call: ast.AST, parents: dict[ast.AST, ast.AST] = parents) -> list[ast.Call]:
            """`.options(...)` calls chained straight onto `call`."""
            out: list[ast.Call] = []
            attr, outer = parents.get(call), None
            while isinstance(attr, ast.Attribute) and attr.attr == "options":
                outer = parents.get(attr)
                if not isinstance(outer, ast.Call):
                    break
                out.append(outer)
                attr = parents.get(outer)
            return out

        for node in ast.walk(tree):
            # @ray.remote (bare) on a function or class: Ray's default, one CPU.
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                for deco in node.decorator_list:
                    if _is_ray_remote(deco):
                        found.append(Launch(module, node.name, deco.lineno, 1.0))
            if not isinstance(node, ast.Call):
                continue
            if _is_ray_remote(node.func):
                # ray.remote(f), ray.remote(**options)(f), @ray.remote(**options): the options
                # given here or chained after.
                target, outer = node, parents.get(node)
                if not node.args and isinstance(outer, ast.Call) and outer.func is node:
                    target = outer
                what = _name(target.args[0]) if target.args else "decorated"
                cpus = _num_cpus(module, node, *chained_options(target))
                found.append(Launch(module, what, node.lineno, 1.0 if cpus is None else cpus))
            elif isinstance(node.func, ast.Attribute) and (
                node.func.attr in DATA_LAUNCHERS
                or (node.func.attr.startswith("read_") and _name(node.func.value) == "ray.data")
            ):
                cpus = _num_cpus(module, node)
                found.append(Launch(module, node.func.attr, node.lineno, 1.0 if cpus is None else cpus))
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "options" and not _on_ray_remote(node):
                # Options given later to a task or actor kept in a variable (`f.options(num_cpus=1)`).
                cpus = _num_cpus(module, node)
                if cpus is not None:
                    found.append(Launch(module, "options", node.lineno, cpus))
    return sorted(found, key=lambda x: (x.module, x.line))


def test_the_scan_finds_every_known_launch_site():
    assert {(x.module, x.what) for x in launches()} >= KNOWN


@pytest.mark.parametrize("node_cpus", NODE_CPUS)
def test_every_task_and_actor_fits_beside_the_default_replica(node_cpus):
    """Each task or actor alone can be scheduled on a node whose default replica is running."""
    free = free_cpus(node_cpus)
    assert free > 0
    too_big = [str(x) for x in launches() if x.num_cpus > free + 1e-9]
    assert not too_big, f"a default replica on {node_cpus} CPUs leaves {free:g}: " + "; ".join(too_big)


@pytest.mark.parametrize("node_cpus", NODE_CPUS)
def test_one_run_fits_beside_the_default_replica(node_cpus):
    """A run's default actor pool at its largest and one read task feeding it, at once (the
    actors hold their CPUs while the reads come and go: without room for a read beside them,
    the pipeline stops)."""
    sites = {(x.module, x.what): x.num_cpus for x in launches()}
    actors = default_max_actors(node_cpus) * sites[("run/pipeline.py", "map_batches")]
    read = sites[("run/pipeline.py", "read_datasource")]
    assert actors + read <= free_cpus(node_cpus) + 1e-9


def test_a_whole_cpu_somewhere_new_fails_the_scan(tmp_path, monkeypatch):
    """The scan sees a new launch site: one asking for a whole CPU, and one asking for nothing."""
    (tmp_path / "new.py").write_text(
        "import ray\n"
        "def f(): ...\n"
        "a = ray.remote(f).options(num_returns=2, num_cpus=1)\n"
        "b = ray.remote(f)\n"
        "c = ray.remote(num_cpus=0.25)(f)\n"
        "def g(ds): return ds.map_batches(f)\n"
        "d = c.options(num_cpus=2)\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path)
    assert [(x.what, x.num_cpus) for x in launches()] == [
        ("f", 1.0),
        ("f", 1.0),
        ("f", 0.25),
        ("map_batches", 1.0),
        ("options", 2.0),
    ]
