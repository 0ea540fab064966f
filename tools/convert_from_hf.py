#!/usr/bin/env python3
"""Import a Hugging Face Llama or MPT model as a dept_mega run directory to start runs from.

    python tools/convert_from_hf.py --hf-dir DIR --config CFG.yaml [key=value ...] --run-dir OUT [--overwrite]
    python tools/convert_from_hf.py --hf-dir DIR --print-model-config

See dept_mega/export/import_run.py and docs/launching.md ("Start from Hugging Face weights").
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dept_mega.export.import_run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
