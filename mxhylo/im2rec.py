"""``python -m mxhylo.im2rec``: pack images into .lst/.rec/.idx for ImageRecordIter.

  python -m mxhylo.im2rec PREFIX FOLDER      # FOLDER/<class>/<image>; label = sorted class position
  python -m mxhylo.im2rec PREFIX LIST.lst    # paths in the list are relative to --root
                                             # (default: the list's directory)
  python -m mxhylo.im2rec --digits OUTDIR    # scikit-learn digits as a ready sample:
                                             # OUTDIR/digits_{train,val}.{lst,rec,idx}

A .lst line is ``index<TAB>label[<TAB>label...]<TAB>path``; with several label
columns every record carries all of them (read with label_width = their number).
A folder writes PREFIX.lst and packs it (with --val-fraction F: PREFIX_train.* and
PREFIX_val.*, a per-class split). Records are shuffled (--seed) unless --no-shuffle:
ImageRecordIter reads, and cuts its num_parts shards, in file order. The output is
readable by mx.io.ImageRecordIter, mxhylo.io.RecordLoader and gluoncv's record datasets.
"""
import argparse
import os
import sys

from mxhylo.io import packing
from mxhylo.io.digits_sample import write_digits


def _parser():
    p = argparse.ArgumentParser(prog="python -m mxhylo.im2rec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", nargs="?", help="output prefix: writes PREFIX.lst/.rec/.idx")
    p.add_argument("source", nargs="?", help="image folder (one sub-folder per class) or a .lst file")
    p.add_argument("--digits", metavar="OUTDIR", help="write the scikit-learn digits sample to OUTDIR")
    p.add_argument("--size", type=int, default=32,
                   help="--digits: side of the upscaled images in pixels (default 32)")
    p.add_argument("--root", help=".lst input: folder the list's paths are relative to")
    p.add_argument("--list-only", action="store_true", help="write the .lst file(s) only")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="fraction of each class for PREFIX_val (folder input; --digits: 0.25)")
    p.add_argument("--no-shuffle", action="store_true", help="keep the sorted folder order")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle and the split")
    p.add_argument("--exts", default=",".join(packing.IMAGE_EXTS),
                   help="image extensions to list (default %(default)s)")
    p.add_argument("--resize", type=int, default=0,
                   help="resize the shorter side to this many pixels (0: keep)")
    p.add_argument("--center-crop", action="store_true", help="keep the central square")
    p.add_argument("--encoding", choices=(".jpg", ".png"), default=".jpg")
    p.add_argument("--quality", type=int, default=None,
                   help="JPEG quality 0-100 (default 95) or PNG compression 0-9 (default 3)")
    p.add_argument("--color", type=int, choices=(-1, 0, 1), default=1,
                   help="OpenCV read flag: 1 colour, 0 grey, -1 unchanged (default 1)")
    p.add_argument("--pass-through", action="store_true",
                   help="store the image files' bytes unchanged (no decode/resize/re-encode)")
    p.add_argument("--num-workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="encoding processes (default %(default)s)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip unreadable images with a warning instead of failing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check_unique(items, where):
    seen = set()
    for index, _, rel in items:
        if index in seen:
            raise SystemExit("error: %s: index %d appears twice (.idx keys must be unique)"
                             % (where, index))
        seen.add(index)


def main(argv=None):
    args = _parser().parse_args(argv)
    progress = not args.no_progress
    if args.digits:
        if args.prefix or args.source:
            raise SystemExit("error: --digits OUTDIR takes no PREFIX/SOURCE")
        frac = 0.25 if args.val_fraction is None else args.val_fraction
        out = write_digits(args.digits, size=args.size, val_fraction=frac, seed=args.seed,
                           encoding=args.encoding, quality=args.quality,
                           num_workers=args.num_workers, progress=progress)
        print("wrote %s.{lst,rec,idx} and %s.{lst,rec,idx}" % (out["train"], out["val"]))
        return 0
    if not args.prefix or not args.source:
        raise SystemExit("error: give PREFIX SOURCE, or --digits OUTDIR (see --help)")
    prefix = args.prefix[:-4] if args.prefix.endswith((".rec", ".lst")) else args.prefix
    if os.path.dirname(prefix):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)

    if os.path.isdir(args.source):
        exts = tuple(e.strip().lower() for e in args.exts.split(",") if e.strip())
        items, classes = packing.list_folder(args.source, exts)
        root = args.source
        print("%d images, %d classes: %s" % (len(items), len(classes),
              ", ".join("%d=%s" % kv for kv in enumerate(classes))), file=sys.stderr)
        frac = args.val_fraction or 0.0
        if frac > 0:
            train, val = packing.split_items(items, frac, args.seed)
            jobs = [(prefix + "_train", train), (prefix + "_val", val)]
        else:
            jobs = [(prefix, items)]
        if not args.no_shuffle:
            jobs = [(p, packing.shuffle_items(its, args.seed)) for p, its in jobs]
        for p, its in jobs:
            packing.write_list(p + ".lst", its)
    elif os.path.isfile(args.source):
        items = packing.read_list(args.source)
        root = args.root or os.path.dirname(os.path.abspath(args.source))
        if os.path.abspath(prefix + ".lst") != os.path.abspath(args.source):
            packing.write_list(prefix + ".lst", items)
        jobs = [(prefix, items)]  # a given list keeps its order: it is the user's
    else:
        raise SystemExit("error: %r is neither an image folder nor a .lst file" % args.source)

    for p, its in jobs:
        _check_unique(its, p + ".lst")
        if args.list_only or not its:
            continue
        try:
            n = packing.pack_items(its, root, p, resize=args.resize, center_crop=args.center_crop,
                                   encoding=args.encoding, quality=args.quality, color=args.color,
                                   num_workers=args.num_workers, skip_bad=args.skip_bad,
                                   progress=progress, passthrough=args.pass_through)
        except packing.PackError as err:
            raise SystemExit("error: %s (use --skip-bad to skip it)" % err)
        print("wrote %s.rec/.idx: %d records" % (p, n), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
