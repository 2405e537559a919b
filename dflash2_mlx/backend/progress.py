"""The one progress bar of long jobs (training data generation, drafter training): rich, on stderr."""

from __future__ import annotations


class ProgressBar:
    """``label``, a bar, ``done/total`` with ``unit``, a free note (speed, metrics), elapsed and
    remaining time. With ``enabled=False`` every method does nothing, so callers need no branches."""

    def __init__(self, total: float, label: str = "", unit: str = "", enabled: bool = True):
        self.enabled = enabled
        self.unit = unit
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn(label),
            BarColumn(bar_width=12),
            TextColumn(f"{{task.completed:.0f}}/{{task.total:.0f}}{' ' + unit if unit else ''}"),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.task = self.progress.add_task(label, total=total, note="")
        self.progress.start()

    def advance(self, n: float) -> None:
        """``n`` more done; the note shows the speed in ``unit``/s."""
        if self.enabled:
            self.progress.advance(self.task, n)
            speed = self.progress.tasks[0].speed
            self.progress.update(self.task, note=f"{speed:.0f} {self.unit}/s" if speed else "")

    def update(self, completed: float, note: str = "") -> None:
        """``completed`` done in all, with ``note`` beside the bar."""
        if self.enabled:
            self.progress.update(self.task, completed=completed, note=note)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
