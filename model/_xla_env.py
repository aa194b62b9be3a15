"""XLA environment set before jax is imported (tests and scripts call this first).

jax/jaxlib 0.10.2 XLA:CPU: the experimental "YNN" fusions segfault on the gradient of some
broadcast-multiply-sum patterns (hit by the KDA chunked backward and a DSA scatter). An empty
`--xla_cpu_experimental_ynn_fusion_type=` disables them; other XLA_FLAGS are kept.
"""

import os

_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def configure_xla_env() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_experimental_ynn_fusion_type" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + _FLAG).strip()
