"""One response's size, bounded as a whole: outputs first, then the fetched files.

Each stream has its own cap (`output_limit_bytes`) and each fetched file too (8 MiB), but not the
response: 100 hard links to one 8 MiB file, all named in `fetch_files`, made a 1.1 GB answer and
grew the service to 3.45 GB. `ResponseBudget` holds one action's `max_response_bytes`, counted as
the JSON the client receives (an output of NUL bytes is six times its size escaped, a file 4/3 in
base64): the outputs are charged first and cut to fit with a marker, then each file is read only
if its base64 fits what is left, and otherwise reported in `message` as not returned, why, and
never read. So the service holds at most about one cap's worth of any response.
"""

from __future__ import annotations

from json.encoder import encode_basestring_ascii

from libra.runtime.sandbox.sandbox import ExecResult

CHUNK = 1 << 16  # characters measured at a time: the escaped copy stays small
CAP_MARKER = "\n[... {n} characters cut: the response is capped at max_response_bytes ({cap}) ...]\n"
FIELD_OVERHEAD = 16  # a file entry's quotes, colon and comma, with room to spare


def json_size(s: str) -> int:
    """Characters `s` takes as a JSON string (json.dumps' default escaping), without the quotes,
    measured a chunk at a time."""
    return sum(len(encode_basestring_ascii(s[i : i + CHUNK])) - 2 for i in range(0, len(s), CHUNK))


def fitting_prefix(s: str, room: int) -> int:
    """The longest prefix of `s` whose JSON size is at most `room`."""
    used = 0
    for i in range(0, len(s), CHUNK):
        chunk = s[i : i + CHUNK]
        size = json_size(chunk)
        if used + size <= room:
            used += size
            continue
        lo, hi = 0, len(chunk)  # within this chunk: the longest prefix that still fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if used + json_size(chunk[:mid]) <= room:
                lo = mid
            else:
                hi = mid - 1
        return i + lo
    return len(s)


class ResponseBudget:
    def __init__(self, cap: int):
        self.cap, self.left = cap, cap

    def charge(self, res: ExecResult) -> ExecResult:
        """Charge an execution's stdout and stderr, cutting them (with a marker) to what is left."""
        res.stdout = self._fit(res, res.stdout)
        res.stderr = self._fit(res, res.stderr)
        return res

    def _fit(self, res: ExecResult, text: str) -> str:
        size = json_size(text)
        if size <= self.left:
            self.left -= size
            return text
        marker = CAP_MARKER.format(n=len(text), cap=self.cap)  # the longest it can read
        keep = fitting_prefix(text, max(0, self.left - len(marker)))
        cut = len(text) - keep
        out = text[:keep] + CAP_MARKER.format(n=cut, cap=self.cap)
        res.capped += cut
        self.left = max(0, self.left - json_size(out))
        return out

    def file_room(self, name: str) -> int:
        """The largest file (raw bytes) whose base64 entry still fits."""
        room = self.left - json_size(name) - FIELD_OVERHEAD
        return max(0, room // 4 * 3)

    def charge_file(self, name: str, size: int) -> None:
        self.left -= json_size(name) + FIELD_OVERHEAD + 4 * (-(-size // 3))

    def refusal(self, size: int) -> str:
        return f"{size} bytes, more than the response has left ({max(0, self.left)} of max_response_bytes {self.cap}, after the outputs and earlier files)"  # fmt: skip
