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
    # and the floor lane is part of `make test`
    test_target = re.search(r"^test: (.*?)\n\n", (REPO / "Makefile").read_text(), flags=re.M | re.S)
    floor_lane = '$(RAY_FLOOR_BIN)/python -m pytest -m "ray and not trainers"'
    assert test_target and floor_lane in test_target.group(1)
