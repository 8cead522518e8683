"""`fusedrl-train` entry point. The trainer is not in this build yet: it runs the loss demo."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from fusedrl.demo import main as demo_main

    return demo_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
