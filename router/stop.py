"""Stop strings: end the text before the first stop string, and never show text past it.

The generated text arrives in pieces, and a stop string may straddle two of them, so text
that could be the start of a stop string is held back until the next piece settles it.
"""

from __future__ import annotations


class StopStringMatcher:
    """Filter one request's text deltas through its stop strings.

    ``feed(text)`` returns ``(visible, stopped)``: the text that is safe to show now, and whether
    a stop string was found (``visible`` then ends right before it and the request is over).
    ``flush()`` returns the text held back when the request ends for another reason.
    """

    def __init__(self, stop: list[str]):
        self._stop = [s for s in stop if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stop:
            return text, False
        buf = self._held + text
        # The held text held no stop string last time, so any match ends inside `text`;
        # taking the earliest match over the whole buffer is therefore exact.
        first, matched = -1, None
        for s in self._stop:
            i = buf.find(s)
            if i != -1 and (first == -1 or i < first):
                first, matched = i, s
        if matched is not None:
            self.stopped, self.matched, self._held = True, matched, ""
            return buf[:first], True
        hold = self._longest_partial_match(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial_match(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
