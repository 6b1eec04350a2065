"""The docs stay true to the code: the generated pages match their generators, every relative link lands on a file
(and heading) in the repository, every KVMESH_* variable the code reads is documented, and the README stays short."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmesh.cli import main
from kvmesh.config_docs import CONFIGURATION_COMMAND, METRICS_COMMAND, configuration_markdown, metrics_markdown
from services.gateway.config import GatewaySettings

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
ENV_READ = re.compile(r"""(?:environ(?:\.get)?\s*[(\[]|getenv\()\s*["'](KVMESH_\w+)["']""")


@pytest.mark.parametrize(
    ("page", "generate", "command"),
    [
        ("configuration.md", configuration_markdown, CONFIGURATION_COMMAND),
        ("metrics.md", metrics_markdown, METRICS_COMMAND),
    ],
)
def test_generated_pages_match_the_code(page: str, generate: Callable[[], str], command: str) -> None:
    written = (ROOT / "docs" / page).read_text()
    assert written == generate(), f"docs/{page} is stale: run `{command}`"


@pytest.mark.parametrize(
    ("flag", "generate"), [("--markdown", configuration_markdown), ("--metrics-markdown", metrics_markdown)]
)
def test_the_cli_prints_the_generated_page(
    flag: str, generate: Callable[[], str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", flag]) == 0
    assert capsys.readouterr().out == generate()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_slug_follows_github() -> None:
    assert slug("Correctness (asserted in `make test`)") == "correctness-asserted-in-make-test"
    assert slug("kvmesh, prefill") == "kvmesh-prefill"
    assert slug("Prefill to decode: the push") == "prefill-to-decode-the-push"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links {broken}"


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move details into docs/"


def test_every_variable_the_code_reads_is_documented() -> None:
    documented = set(re.findall(r"^\| `(KVMESH_\w+)`", (ROOT / "docs" / "configuration.md").read_text(), re.MULTILINE))
    read = {
        name
        for folder in ("libs", "services")
        for path in (ROOT / folder).rglob("*.py")
        for name in ENV_READ.findall(path.read_text())
    }
    assert "KVMESH_MODEL_DIR" in read  # the pattern finds reads outside the settings classes
    assert read - documented == set(), "declare these in mesh.config.OTHER_VARIABLES (or as a setting)"


def test_a_secret_setting_stays_out_of_repr_and_docs() -> None:
    settings = GatewaySettings(api_keys=("sk-secret",))
    assert "sk-secret" not in repr(settings)
    assert "| `KVMESH_API_KEYS` | gateway | (none) |" in configuration_markdown()
