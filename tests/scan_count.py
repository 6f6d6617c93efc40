"""Counting the strict JSON engine's reads. The runtime's C scanner and its string reader
are what section 3 reads every document with (the exact walk of a refused one reads its
strings with the same reader): each is wrapped here so that every call notes how many
characters it read, up to where it stopped, or, when it failed, to the end of the text (all
it may have read). Counts only: never a time."""

from proxy_harness import ap


class Scans:
    """Every read of the engine from now on, as the number of characters each one read."""

    def __init__(self, monkeypatch):
        self.reads: list[int] = []
        scanner, string = ap._SCANNER, ap._SCAN_STRING

        def make_scanner(hooks):
            scan = scanner(hooks)

            def counted(text, pos):
                try:
                    value, end = scan(text, pos)
                except (ValueError, StopIteration):
                    self.reads.append(len(text) - pos)
                    raise
                self.reads.append(end - pos)
                return value, end
            return counted

        def counted_string(text, end, strict):
            try:
                value, stop = string(text, end, strict)
            except ValueError:
                self.reads.append(len(text) - end)
                raise
            self.reads.append(stop - end)
            return value, stop

        monkeypatch.setattr(ap, "_SCANNER", make_scanner)
        monkeypatch.setattr(ap, "_SCAN_STRING", counted_string)

    def total(self) -> int:
        return sum(self.reads)

    def at_least(self, size: int) -> list[int]:
        """The reads of ``size`` characters or more."""
        return [n for n in self.reads if n >= size]

    def clear(self) -> None:
        self.reads.clear()
