"""Print the tests whose outcome differs between two junit files (GRPOTrainer, FusedGRPOTrainer)
and each run's counts; exit 1 where any differs."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        state, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                state, message = "failed", (child.get("message") or "")[:200]
                break
            if child.tag == "skipped":
                state = "skipped"
                break
        found[name] = (state, message)
    return found


def main(trl_run: str, fused_run: str) -> int:
    trl, fused = outcomes(trl_run), outcomes(fused_run)
    print("GRPOTrainer:     ", dict(Counter(state for state, _ in trl.values())))
    print("FusedGRPOTrainer:", dict(Counter(state for state, _ in fused.values())))
    differing = 0
    for name in sorted(trl.keys() | fused.keys()):
        ours, theirs = fused.get(name, ("missing", "")), trl.get(name, ("missing", ""))
        if ours[0] != theirs[0]:
            differing += 1
            print(f"DIFFERS {name}: GRPOTrainer {theirs[0]}, FusedGRPOTrainer {ours[0]} {ours[1]}")
    print(f"{differing} tests differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
