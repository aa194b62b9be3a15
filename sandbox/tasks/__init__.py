"""Task families and loaders (JSONL task files, HumanEval and MBPP formats)."""

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
           "load_mbpp", "load_tasks", "mbpp_task", "save_tasks"]
