"""Print the slowest tests of one or more JUnit XML reports (pytest --junitxml), and each report's total."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    cases: list[tuple[float, str]] = []
    for path in args.reports:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as err:
            print(f"{path}: unreadable ({err})")
            continue
        total = 0.0
        for case in root.iter("testcase"):
            seconds = float(case.get("time", 0.0))
            total += seconds
            cases.append((seconds, f"{case.get('classname', '')}::{case.get('name', '')}"))
        print(f"{path}: {sum(1 for _ in root.iter('testcase'))} tests, {total:.0f} s in tests")
    print(f"slowest {args.top}:")
    for seconds, name in sorted(cases, reverse=True)[: args.top]:
        print(f"{seconds:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
