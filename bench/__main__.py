"""`python -m bench`: every benchmark; for now the trainer's."""

from __future__ import annotations

from bench import trainer

if __name__ == "__main__":
    trainer.main()
