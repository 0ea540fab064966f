#!/usr/bin/env python3
"""Export a run's source model(s) as Hugging Face ``transformers`` model directories.

    python tools/convert_to_hf.py --run-dir RUN [--step S] (--source NAME | --all-sources) --output DIR [--overwrite]

See dept_mega/export/convert.py and docs/launching.md ("Export").
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dept_mega.export.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
