"""The optional extras' bounds are the versions the test set-up tests: the [ray] extra's floor is the Ray that
``make test`` runs the Ray tests on a second time (``.venv-ray-floor``, the Makefile's ``RAY_FLOOR``)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_ray_extras_floor_is_the_ray_the_floor_lane_tests():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = extras["ray"]
    floor = re.fullmatch(r"ray>=([\d.]+),<3", requirement)
    assert floor, requirement
    tested = re.search(r"^RAY_FLOOR := ([\d.]+)$", (REPO / "Makefile").read_text(), flags=re.M)
    assert tested, "the Makefile pins the floor lane's Ray (RAY_FLOOR)"
    assert tested.group(1) == floor.group(1)
    # and the floor lane is a tier of `make test` (tests/test_tiers.py runs them dry)
    makefile = (REPO / "Makefile").read_text()
    tiers = re.search(r"^TEST_TIERS := (.*)$", makefile, flags=re.M)
    floor_target = re.search(r"^test-ray-floor: (.*?)\n\n", makefile, flags=re.M | re.S)
    floor_lane = '$(RAY_FLOOR_BIN)/python -m pytest -m "ray and not trainers"'
    assert tiers and "test-ray-floor" in tiers.group(1).split()
    assert floor_target and floor_lane in floor_target.group(1)
