"""The code's citations of docs/METHODS.md point at anchors that exist there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"docs/METHODS\.md((?:#[a-z0-9-]+)(?:, #[a-z0-9-]+)*)")


def test_every_cited_methods_anchor_exists():
    anchors = set(re.findall(r'<a id="([a-z0-9-]+)"></a>', (ROOT / "docs" / "METHODS.md").read_text()))
    cited: dict[str, set[str]] = {}
    for folder in ("fedhm_flwr", "strategies", "clients", "conf", "tests", "bench", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml", ".md") and path.is_file():
                for group in CITED.findall(path.read_text(encoding="utf-8")):
                    for anchor in re.findall(r"#([a-z0-9-]+)", group):
                        cited.setdefault(anchor, set()).add(str(path.relative_to(ROOT)))
    assert len(cited) >= 10  # the method modules and configs cite it
    missing = {a: sorted(p) for a, p in cited.items() if a not in anchors}
    assert not missing, f"anchors cited but absent from docs/METHODS.md: {missing}"
