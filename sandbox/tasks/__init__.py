"""Tasks: the record (schema.py), loaders of task files, and the task domains.

    from sandbox.tasks import Task, load_tasks, load_humaneval, load_task_dir

    schema.py     Task (the record; `family` names its scoring method, sandbox/verifiers.py)
    loaders.py    this project's JSONL, HumanEval and MBPP files; (task, demo) pair files
    folders.py    Terminal-Bench/Harbor-style task folders
    domains/      the task domains, one file each, and their registry (domains/__init__.py)
    splits.py     the split rule (a task's split is a hash of its canonical key)
    sampling.py   make_split / make_mixture of the generated domains, by name
    sft.py        SFT mixing: demonstrations with a share of corrupted ones

Names are imported lazily (like the `sandbox` package), so importing sandbox.tasks.schema, as
sandbox/verifiers.py does, runs none of the loaders (which check tasks with the verifiers).
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "Task": "schema", "TaskFormatError": "schema",
    "humaneval_task": "loaders", "iter_jsonl": "loaders", "load_humaneval": "loaders",
    "load_mbpp": "loaders", "load_tasks": "loaders", "mbpp_task": "loaders", "save_tasks": "loaders",
    "load_task_dir": "folders", "load_task_dirs": "folders",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
