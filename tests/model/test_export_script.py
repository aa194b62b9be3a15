"""scripts/export.py's request check (what --dry_run runs, and what every run checks first):
flags a mode does not use are rejected, bad flag combinations get an error naming the fix, and
missing inputs are notes naming the command that makes them.

Covered: check_request on the smoke RL config and the tiny model config, for plan / export /
import. Not covered here: the documented command lines with --dry_run (tests/test_docs_commands
.py runs them); a found orbax checkpoint (the dry run was checked by hand on a real run); the
export and import themselves (tests/model/test_mxfp4_e2e.py).

The script defines absl flags (--config, --dry_run) that scripts/plan.py defines too, so it is
loaded in a child interpreter, which runs every case and returns the outcomes as JSON.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = r"""
import json, os, runpy, sys
sys.path[:0] = [{root!r}, os.path.join({root!r}, "scripts")]
os.chdir({root!r})
mod = runpy.run_path("scripts/export.py", run_name="export_under_test")
from configs import models, rl
out = []
for name, kw in json.loads(sys.stdin.read()):
    config = rl.get_config("smoke") if name == "smoke" else models.get_config(name)
    for k, v in kw.pop("config_overrides", {{}}).items():
        *sec, field = k.split(".")
        node = config
        for x in sec:
            node = node[x]
        node[field] = v
    args = dict(mode="export", checkpoint="sft", out="", experts="mxfp4", dtype="keep",
                max_shard_mb=0.0, given=set(), config_cli="--config configs/rl.py:smoke")
    args.update(kw)
    args["given"] = set(args["given"])
    try:
        out.append(["ok", mod["check_request"](config, **args)])
    except ValueError as e:
        out.append(["error", str(e)])
print(json.dumps(out))
"""


def _run(cases):
    p = subprocess.run([sys.executable, "-c", _CHILD.format(root=ROOT)], input=json.dumps(cases),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_check_request(tmp_path):
    work = str(tmp_path / "work")
    cli = f"--config configs/rl.py:smoke --config.workdir={work}"
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    (export_dir / "model.safetensors.index.json").write_text("{}")
    cases = {
        # valid requests: notes say what is missing and which command makes it
        "plan": ("tiny", dict(mode="plan", given=["config", "experts"])),
        "export sft missing": ("smoke", dict(out="o", config_overrides={"workdir": work},
                                             config_cli=cli)),
        "export rl missing": ("smoke", dict(checkpoint="rl", out="o",
                                            config_overrides={"workdir": work})),
        "export dir missing": ("smoke", dict(checkpoint=str(tmp_path / "nope"), out="o")),
        "export init": ("tiny", dict(checkpoint="init", out="o")),
        "import missing": ("smoke", dict(mode="import", out=str(tmp_path / "none"),
                                         given=["out"])),
        "import found": ("smoke", dict(mode="import", out=str(export_dir), given=["out"])),
        # invalid flag combinations
        "plan with out": ("tiny", dict(mode="plan", out="o", given=["out"])),
        "import with config": ("smoke", dict(mode="import", out="o",
                                              given=["out", "config", "experts"])),
        "import without out": ("smoke", dict(mode="import", given=[])),
        "export without out": ("smoke", dict()),
        "negative shard size": ("tiny", dict(mode="plan", max_shard_mb=-1.0)),
        "model config, sft": ("tiny", dict(out="o")),
        "experts kept high precision": ("smoke", dict(out="o", config_overrides={
            "quant.high_precision": "experts,shared_experts,dense_ffn,router,attention,"
                                    "embeddings,lm_head,norms"})),
        "unquantisable group left out": ("smoke", dict(mode="plan", config_overrides={
            "quant.high_precision": "router,attention,embeddings,lm_head,norms"})),
        "bad mode": ("tiny", dict(mode="convert")),
    }
    names = list(cases)
    res = dict(zip(names, _run([[c[0], c[1]] for c in cases.values()])))

    def ok(name, *needles):
        kind, notes = res[name]
        assert kind == "ok", (name, notes)
        text = "\n".join(notes)
        for n in needles:
            assert n in text, (name, n, text)

    def err(name, *needles):
        kind, msg = res[name]
        assert kind == "error", (name, msg)
        for n in needles:
            assert n in msg, (name, n, msg)

    ok("plan", "model tiny: experts mxfp4")
    ok("export sft missing", f"checkpoint {work}/sft/checkpoints: not found; run scripts/sft.py"
       f" {cli} first")
    ok("export rl missing", f"{work}/rl/checkpoints: not found; run scripts/train_rl.py")
    ok("export dir missing", "nope: not found (not an orbax checkpoint directory")
    ok("export init", "checkpoint init: a freshly initialised model")
    ok("import missing", "not found (no model.safetensors.index.json); run scripts/export.py "
       "--mode=export")
    ok("import found", "found (model.safetensors.index.json)")
    err("plan with out", "--mode=plan does not use --out")
    err("import with config", "--mode=import does not use --config, --experts",
        "config.json")
    err("import without out", "--out=DIR")
    err("export without out", "--out=DIR is required for --mode=export")
    err("negative shard size", "--max_shard_mb must be >= 0")
    err("model config, sft", "needs an RL config", "--checkpoint=init")
    err("experts kept high precision", "--experts=bf16", "remove 'experts'")
    err("unquantisable group left out", "has no MXFP4 path")
    err("bad mode", "--mode must be one of")
    assert not (tmp_path / "o").exists() and not os.path.exists(os.path.join(ROOT, "o"))
