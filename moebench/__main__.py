"""`python -m moebench` and the `moebench` command (the H200 host runs from PYTHONPATH)."""

import sys


def main() -> None:
    """Run the command line. A Ctrl-C while it still imports (torch takes
    seconds) exits 130 with one line instead of a traceback from inside an
    import."""
    try:
        from moebench.cli import app
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C) while moebench was starting", file=sys.stderr)
        raise SystemExit(130) from None
    app(prog_name="moebench")


if __name__ == "__main__":
    main()
