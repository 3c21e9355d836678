"""`python -m fusedpar <command>`; see `python -m fusedpar --help`."""

import sys


def main(argv: list[str] | None = None) -> int:
    from fusedpar.demo import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
