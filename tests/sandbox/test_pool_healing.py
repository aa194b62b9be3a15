"""A pool that heals: nothing a program leaves in /work reaches the next run
(each run gets a fresh tmpfs), a FIFO never stalls a later sequence step, a slot whose reset
fails is replaced (never reused), and `health()` reports slots that are down.

Before the fix: a tree ~1,000 deep made the reset raise RecursionError and the slot answered
every later run with sandbox_error over the files it left; a FIFO stalled a later step for a
minute (until the worker was declared hung)."""

import os
import signal
import subprocess
import time

from sandbox import SandboxPool
from sandbox.config import SandboxConfig
from sandbox.host import _slot_dir

LEFTOVERS = {
    "deep_tree_python": ("import os\nfor _ in range(5000):\n    os.mkdir('d')\n    os.chdir('d')\n"
                         "print(os.getcwd().count('/'))", "python"),
    "deep_tree_bash": ("mkdir -p $(printf 'd/%.0s' $(seq 1200)) && find . -type d | wc -l", "bash"),
    "fifos_and_socket": ("mkfifo f g; mkdir -p x/y; mkfifo x/y/h; python3 -c \"import socket; "
                         "socket.socket(socket.AF_UNIX).bind('sock')\"; (cat f > /dev/null &); echo ok", "bash"),
    "unreadable": ("mkdir -p a/b/c; touch a/b/c/f; chmod 000 a/b/c/f a/b/c a/b a; chmod 4777 ok 2>/dev/null; "
                   "chattr +i a 2>/dev/null; chmod 000 /work; echo ok", "bash"),
    "odd_names": ("touch $'new\\nline' $'\\xff\\xfe' $'\\t' ' ' -- -rf --help '*' '\\' "
                  "\"$(printf 'x%.0s' $(seq 255))\"; ln -s loop loop; ln -s /proc/self/root up; "
                  "mkdir $'\\x01dir'; echo ok", "bash"),
    "full_disk": ("dd if=/dev/zero of=big bs=1M count=500 2>/dev/null; df -k --output=avail . | tail -1", "bash"),
    "no_inodes": ("i = 0\ntry:\n    while True:\n        open('f%d' % i, 'w').close()\n        i += 1\n"
                  "except OSError as e:\n    print(i, e.errno)", "python"),
    "background_writer": ("(while true; do echo x >> log; done &) ; sleep 0.2; echo ok", "bash"),
}


def test_leftovers_never_reach_the_next_run(pool, clean_next):
    futs = {name: pool.submit(code, language=lang, timeout_s=60)
            for name, (code, lang) in LEFTOVERS.items()}
    res = {name: f.result() for name, f in futs.items()}
    assert all(r.status == "ok" for r in res.values()), {n: (r.status, r.stderr[-300:]) for n, r in res.items()}
    assert int(res["deep_tree_python"].stdout) == 5001 and int(res["deep_tree_bash"].stdout) == 1201
    assert int(res["no_inodes"].stdout.split()[0]) > 1000
    clean_next(pool, probes_per_slot=3)
    h = pool.health()
    assert h["replaced"] == 0 and h["restarts"] == 0  # healed by the fresh mount, not replaced


def test_fifo_never_stalls_a_later_step(pool, clean_next):
    rs = pool.run_sequence([
        {"code": "mkfifo in.txt out.txt", "language": "bash"},
        {"code": "cat in.txt", "language": "bash", "files": {"in.txt": "data"}},  # placing over a FIFO
        {"code": "cat out.txt", "language": "bash", "timeout_s": 1},  # the program itself blocks
        {"code": "echo still here", "language": "bash"},
    ])
    assert [r.status for r in rs] == ["ok", "error", "timeout", "ok"], rs
    assert rs[1].exit_code is None and "in.txt" in rs[1].message and "earlier step" in rs[1].message
    assert rs[3].stdout == "still here\n"
    clean_next(pool)


def test_a_step_cannot_lock_the_next_one_out(pool, clean_next):
    """/work's own mode and owner are restored between steps (before: `chmod 000 /work` made the
    next step's sandbox fail to start, a sandbox_error caused by the program)."""
    rs = pool.run_sequence([{"code": "echo kept > f; chmod 000 f /work", "language": "bash"},
                            {"code": "chmod u+r f; cat f; stat -c %a /work", "language": "bash"}])
    assert [r.status for r in rs] == ["ok", "ok"] and rs[1].stdout == "kept\n700\n", rs
    clean_next(pool)


def _sabotage_work(uid: int) -> str:
    """From the host (root): take the slot's /work mount away and put a file where it was, so
    that mounting a fresh /work there fails (ENOTDIR), as any reset failure would."""
    work = os.path.join(_slot_dir(SandboxConfig(), uid), "work")
    subprocess.run(["umount", "-l", work], check=True)
    os.rmdir(work)
    with open(work, "w") as f:
        f.write("not a directory")
    return work


def test_a_slot_whose_reset_fails_is_replaced():
    with SandboxPool(workers=1) as p:
        assert p.run("print(1)").ok
        uid0, pid0 = p.worker_uids()[0], p.worker_pids()[0]
        # 1) broken between runs: the next run finds /work not fresh, cannot reset it, answers
        #    sandbox_error (not the program's doing) and the slot is replaced
        _sabotage_work(uid0)
        r = p.run("print('never runs on the broken slot')")
        assert r.status == "sandbox_error" and "broken" in r.message, r
        h = p.health()
        assert h["replaced"] == 1 and h["up"] == 1 and p.worker_pids()[0] != pid0
        assert "cannot reset" in h["last_replacement"]
        r = p.run("import os; print(os.listdir('.'))")
        assert r.status == "ok" and r.stdout == "[]\n"
        # 2) broken during a run: the run's own result comes back, then the slot is replaced
        uid1, pid1 = p.worker_uids()[0], p.worker_pids()[0]
        fut = p.submit("import time; open('mine', 'w').write('x'); time.sleep(1.0); print('done')")
        mine = os.path.join(_slot_dir(SandboxConfig(), uid1), "work", "mine")
        deadline = time.monotonic() + 60
        while not os.path.exists(mine) and time.monotonic() < deadline:  # the program runs
            time.sleep(0.01)
        _sabotage_work(uid1)
        r = fut.result()
        assert r.status == "ok" and r.stdout == "done\n", r
        r = p.run("import os; print(os.listdir('.'))")
        assert r.status == "ok" and r.stdout == "[]\n"
        h = p.health()
        assert h["replaced"] == 2 and p.worker_pids()[0] not in (pid0, pid1) and h["up"] == 1


def test_health_reports_a_dead_worker_as_down_until_replaced():
    with SandboxPool(workers=2) as p:
        h = p.health()
        assert h["up"] == 2 and h["down"] == [] and [s["state"] for s in h["slots"]] == ["idle", "idle"]
        os.kill(p.worker_pids()[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while p.health()["up"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        h = p.health()
        assert h["down"] == [1] and h["slots"][1]["state"] == "down"
        rs = p.map(["print(1)"] * 6)  # found dead before it gets a task: replaced, nothing lost
        assert all(r.status == "ok" for r in rs), rs
        h = p.health()
        assert h["up"] == 2 and h["restarts"] == 1 and "died while idle" in h["last_replacement"]
    assert p.health()["up"] == 0  # closed
