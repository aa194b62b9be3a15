"""Task families and loaders (JSONL task files, HumanEval and MBPP formats, task folders).

The generated families live in generators.py (one-shot) and multistep.py (multi-step episodes);
folders.py loads Terminal-Bench/Harbor-style task folders."""

from .folders import load_task_dir, load_task_dirs
from .loaders import (
                      humaneval_task,
                      iter_jsonl,
                      load_humaneval,
                      load_mbpp,
                      load_tasks,
                      mbpp_task,
                      save_tasks,
)
from .schema import FAMILIES, Task, TaskFormatError

__all__ = ["FAMILIES", "Task", "TaskFormatError", "humaneval_task", "iter_jsonl", "load_humaneval",
           "load_mbpp", "load_task_dir", "load_task_dirs", "load_tasks", "mbpp_task", "save_tasks"]
