"""Where the kernels' sources are found: the repository keeps them in native/ at its top, a wheel
ships them inside the package as l2core/native/ (pyproject.toml's package-dir); a checkout on
PYTHONPATH and an editable install read the top-level one. Missing sources are one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from l2core import _native

REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path, *dirs: str) -> Path:
    for d in dirs:
        (root / d / "csrc").mkdir(parents=True)
    (root / "l2core").mkdir(exist_ok=True)
    return root / "l2core"


def test_this_checkout_builds_from_its_top_level_native() -> None:
    assert _native._ROOT == REPO / "native"
    assert (_native._ROOT / "csrc" / "bindings.cpp").is_file() and (_native._ROOT / "include").is_dir()
    assert not (REPO / "l2core" / "native").exists()  # one copy in the tree


@pytest.mark.parametrize(
    ("dirs", "found"),
    [
        (("l2core/native",), "l2core/native"),  # an installed wheel
        (("native",), "native"),  # a checkout or an editable install
        (("l2core/native", "native"), "l2core/native"),  # the package's own copy first
        ((), "l2core/native"),  # neither: load() says so
    ],
)
def test_find_sources(tmp_path: Path, dirs: tuple[str, ...], found: str) -> None:
    assert _native._find_sources(_tree(tmp_path, *dirs)) == tmp_path / found


def test_load_without_sources_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = _tree(tmp_path)
    monkeypatch.setattr(_native, "_PACKAGE", package)
    monkeypatch.setattr(_native, "_ROOT", _native._find_sources(package))
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setenv("L2CORE_BUILD_DIR", str(tmp_path / "build"))
    with pytest.raises(_native.NativeBuildError) as e:
        _native.load()
    assert str(e.value) == (
        f"l2core's native sources are missing: neither {package / 'native'} (installed) nor "
        f"{tmp_path / 'native'} (checkout) holds csrc/: reinstall"
    )
    assert not (tmp_path / "build").exists()
