"""`python -m moebench`: the command line (the H200 host runs from PYTHONPATH)."""

from moebench.cli import app

if __name__ == "__main__":
    app(prog_name="moebench")
