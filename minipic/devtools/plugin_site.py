"""A child process whose vLLM finds minipic as `pip install minipic` would leave it: through
the `vllm.general_plugins` entry point, with minipic imported from this checkout (the GPU
host runs the tests from a checkout, where no entry point exists)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def plugin_env(root: Path) -> dict[str, str]:
    """The environment for such a child: an entry point written under `root`, the engine
    in-process (the child can patch and count what runs) and no model hub."""
    dist = root / "site" / "minipic-0.1.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: minipic\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nminipic = minipic.plugin:register\n")
    return dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join([str(root / "site"), str(REPO),
                                            os.environ.get("PYTHONPATH", "")]))
