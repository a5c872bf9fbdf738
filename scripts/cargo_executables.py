"""The executables a cargo build made, from its `--message-format=json` lines on stdin:
one a line as `PACKAGE/TARGET PATH`, or the path alone with `--paths`. `--only NAME...`
keeps those target names, `--except NAME...` drops them.

    cargo test --no-run --message-format=json ... | python3 scripts/cargo_executables.py [--paths] [--only T...] [--except T...]
"""

import argparse
import json
import sys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", action="store_true", help="print the paths alone")
    p.add_argument("--only", nargs="+", default=None, metavar="TARGET")
    p.add_argument("--except", dest="excluded", nargs="+", default=[], metavar="TARGET")
    args = p.parse_args()
    for line in sys.stdin:
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") != "compiler-artifact" or not m.get("executable"):
            continue
        target = m["target"]["name"]
        if (args.only is not None and target not in args.only) or target in args.excluded:
            continue
        if args.paths:
            print(m["executable"])
        else:
            package = m["package_id"].split("#")[0].rstrip("/").split("/")[-1]
            print(f"{package}/{target} {m['executable']}")


if __name__ == "__main__":
    main()
