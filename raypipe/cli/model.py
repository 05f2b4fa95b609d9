"""`raypipe model`: build the demo model, export a checkpoint, optimize and check a model directory."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from raypipe.cli.parser import EXIT_BAD_CONFIG, EXIT_OK


def model_command(args: argparse.Namespace) -> int:
    from serve_app.model import ModelDirError

    try:
        if args.model_command == "build-demo":
            from serve_app.demo_model import build_demo_model

            print(build_demo_model(args.dir, force=args.force))
        elif args.model_command == "export":
            print(_export(args))
        elif args.model_command == "optimize":
            _optimize(args)
        else:
            from serve_app.export import check_model_dir
            from serve_app.optimize import render_table
            from serve_app.runtimes import read_records

            print(check_model_dir(args.dir, texts=args.text).render())
            for record in read_records(args.dir):  # one per CPU class that measured
                print()
                print(render_table(record, threshold=args.threshold))
    # ModelDirError (and ExportError, a subclass) names the file at fault; ValueError is a bad
    # argument (a version name, a label list).
    except (ModelDirError, ValueError) as e:
        print(f"raypipe: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return EXIT_OK


def _optimize(args: argparse.Namespace) -> None:
    import os

    from serve_app.optimize import default_sample, optimize, read_sample, render_table, split_sample

    if args.sample:
        texts, source = read_sample(args.sample, text_column=args.text_column, rows=args.rows), args.sample
    else:
        texts, source = default_sample(args.rows), "default sample (check texts, generated demo paragraphs)"
    sample = split_sample(texts, source=source)
    result = optimize(
        args.dir,
        sample,
        threshold=args.threshold,
        threads=args.threads or os.cpu_count() or 1,
        int8=not args.no_int8,
        int8_max_reverts=args.int8_max_reverts,
    )
    if "error" in result.int8:
        print(f"int8: not built, NNCF could not hold the agreement: {result.int8['error']}")
    print(render_table(result.record, threshold=args.threshold))
    print(f"written: {result.record_path}")


def _export(args: argparse.Namespace) -> Any:
    from serve_app.export import export_hf_checkpoint, export_saved_model

    labels = None if args.labels is None else [x.strip() for x in args.labels.split(",")]
    common: dict[str, Any] = {"max_sequence_length": args.max_length, "name": args.name, "overwrite": args.force}
    if args.from_hf is not None:
        if args.signature != "serving_default" or args.output is not None or args.output_kind != "auto":
            raise ValueError("--signature, --output and --output-kind apply to --from-savedmodel only")
        return export_hf_checkpoint(args.from_hf, args.out, labels=labels, tokenizer_dir=args.tokenizer, **common)
    if labels is None or args.tokenizer is None:
        raise ValueError("--from-savedmodel needs --labels and --tokenizer")
    return export_saved_model(
        args.from_savedmodel,
        args.out,
        labels=labels,
        tokenizer_dir=args.tokenizer,
        signature=args.signature,
        output=args.output,
        output_kind=args.output_kind,
        **common,
    )
