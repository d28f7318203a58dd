"""Every example (and the demo) runs in quick mode and draws non-trivial pictures.

The scripts run as subprocesses, as a user runs them, all started at once on a small
pool (each uses one torch thread), so the file takes about as long as the slowest few.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib.image
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PICTURES = {
    "demo.py": ["demo_methods.png", "demo_per_target.png"],
    **{p.name: [p.with_suffix(".png").name] for p in sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))},
}
NO_TDHOOK = "06_migrating_from_tdhook.py without tdhook"


def _run(script: str, out: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPLBACKEND": "Agg", "TQDM_DISABLE": "1"}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(EXAMPLES / script), "--quick", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Run every script once, in parallel; name -> (process, its --out folder)."""
    blocker = tmp_path_factory.mktemp("no_tdhook")
    (blocker / "tdhook.py").write_text("raise ImportError('tdhook is hidden for this test')\n")
    jobs = {name: (name, tmp_path_factory.mktemp(name.replace(".", "_")), None) for name in PICTURES}
    jobs[NO_TDHOOK] = ("06_migrating_from_tdhook.py", tmp_path_factory.mktemp("no_tdhook_out"), blocker)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        futures = {name: pool.submit(_run, script, out, extra) for name, (script, out, extra) in jobs.items()}
        return {name: (future.result(), jobs[name][1]) for name, future in futures.items()}


def _check_picture(path: Path) -> None:
    assert path.exists(), f"{path.name} was not written"
    assert path.stat().st_size > 5_000, f"{path.name} is only {path.stat().st_size} bytes"
    pixels = matplotlib.image.imread(path)
    assert pixels.std() > 0, f"{path.name} is a single colour"


@pytest.mark.parametrize("script", list(PICTURES))
def test_example_runs_and_draws(runs, script: str) -> None:
    process, out = runs[script]
    assert process.returncode == 0, f"{script} failed:\n{process.stdout}\n{process.stderr}"
    for picture in PICTURES[script]:
        _check_picture(out / picture)
    assert "Traceback" not in process.stderr


def test_migration_example_runs_without_tdhook(runs) -> None:
    process, out = runs[NO_TDHOOK]
    assert process.returncode == 0, process.stderr
    assert "tdhook is not installed" in process.stdout
    _check_picture(out / "06_migrating_from_tdhook.png")


def test_every_example_is_tested() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(PICTURES)
