#!/usr/bin/env python
"""Convert a DeepSpeed checkpoint tag into a universal checkpoint, loadable on any TP, PP and DP.

    tools/convert_checkpoint/ds_to_universal.py --input_folder CKPT/global_stepN \\
        --output_folder CKPT/global_stepN_universal
    pretrain_gpt.py ... --load CKPT --universal-checkpoint     # any new layout

Wraps DeepSpeed's own converter (``deepspeed.checkpoint.ds_to_universal``), which writes
``CKPT/latest_universal``; this wrapper first refuses an incomplete input tag, then copies our
``run_state.json`` and marks the output ``complete`` (our loader refuses tags without it), so a
crashed conversion is never loaded.
Options other than the two folders are passed through to DeepSpeed's converter.
"""

import argparse
import os
import shutil
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(argv=None) -> int:
    from deepspeed.checkpoint import ds_to_universal as converter

    from megatron.checkpoint.tags import COMPLETE_MARKER, RUN_STATE, write_complete_marker

    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--input_folder", required=True)
    ours.add_argument("--output_folder", required=True)
    known, _ = ours.parse_known_args(argv)
    if not os.path.isfile(os.path.join(known.input_folder, COMPLETE_MARKER)):
        raise SystemExit(f"{known.input_folder} has no '{COMPLETE_MARKER}' marker: it is not a finished checkpoint "
                         f"(was the save interrupted?); convert a complete one")
    args = converter.parse_arguments() if argv is None else _parse_with(converter, argv)
    converter.main(args)
    shutil.copyfile(os.path.join(known.input_folder, RUN_STATE), os.path.join(known.output_folder, RUN_STATE))
    write_complete_marker(known.output_folder, os.path.basename(os.path.normpath(known.input_folder)))
    print(f"universal checkpoint written to {known.output_folder}")
    return 0


def _parse_with(converter, argv):
    saved = sys.argv
    sys.argv = ["ds_to_universal"] + list(argv)
    try:
        return converter.parse_arguments()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    sys.exit(main())
