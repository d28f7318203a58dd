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


def test_colour_scale_is_not_set_by_one_extreme_pixel() -> None:
    """A map with one outlier pixel still spreads its other pixels over most of the colour range.

    (The demo's integrated-gradients column once shared a scale set by one pixel of one map;
    five of its six maps showed as blank.)
    """
    import sys

    import torch

    sys.path.insert(0, str(EXAMPLES))
    try:
        from _plots import robust_limit
    finally:
        sys.path.remove(str(EXAMPLES))
    values = torch.linspace(-1.0, 1.0, 28 * 28).reshape(28, 28)
    values[3, 4] = 100.0  # one pixel a hundred times the rest
    limit = robust_limit(values)
    assert 0.9 <= limit <= 1.0, limit  # the other pixels span (nearly) the whole scale
    shown = (values.abs() / limit).clamp(max=1.0)
    assert float((shown > 0.5).float().mean()) > 0.45  # half the pixels in the outer half of the colour bar
    assert robust_limit(torch.zeros(5, 5)) == 1.0
    sparse = torch.zeros(10, 10)
    sparse[0, 0] = 2.0  # mostly zero: the scale falls back to the max
    assert robust_limit(sparse) == 2.0
