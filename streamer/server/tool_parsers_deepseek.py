"""Tool calls in DeepSeek's markup, the formats deepseek_v3 and deepseek_v31 (vLLM's names):

  deepseek_v3    CALLS_BEGIN CALL_BEGIN function SEP NAME "\\n```json\\n" ARGS "\\n```" CALL_END ... CALLS_END
                 (DeepSeek-V3, V3-0324, R1-0528; its template joins the calls with "\\n")
  deepseek_v31   CALLS_BEGIN CALL_BEGIN NAME SEP ARGS CALL_END ... CALLS_END
                 (DeepSeek-V3.1 and later; the calls follow each other directly)

The markers (chat_template.DEEPSEEK_MARKERS, "<｜tool▁calls▁begin｜>" and so on) are special
tokens of DeepSeek's tokenizers, which skip_special_tokens drops: a request these streams
parse keeps them in its text (ToolParser.markers, SamplingParams.keep_special_tokens).

Each stream is a ToolStream and keeps its contract (tool_stream.py): content streams as it
arrives up to CALLS_BEGIN; a call is emitted, id and name then its whole arguments, once its
JSON has closed and what follows shows whether its tail came; malformed markup turns back
into content verbatim, markers included, and the text after it is read again. In detail:

- ARGS is a JSON object, found by bracket counting (JsonEnd): a marker or a fence inside an
  argument string cannot cut it. Its tail (V3: the closing fence, then CALL_END; V3.1:
  CALL_END) is consumed where it comes and forgiven where it does not: a call whose JSON has
  closed is complete, so the output may end there (a tail or CALLS_END cut off by the end of
  output is dropped with it), or go on with the next call.
- Between calls: whitespace, then the next CALL_BEGIN, or CALLS_END (which closes the block:
  text after it is content again), or anything else (the block ends there, that is content).
- Leniency where models vary: V3's type (the word before SEP, "function") may be any word,
  its fence "```json" or "```" or none, with whitespace around; whitespace around NAME.
- NAME has no whitespace and no "｜" (no marker), and must end within NAME_MAX characters.
- The output ending inside a call (before its JSON has closed): that markup is content, as
  for the other formats (hermes's unclosed JSON).
"""

from __future__ import annotations

import json
import re

from streamer.chat_template import DEEPSEEK_MARKERS
from streamer.server.text_pieces import partial_tag
from streamer.server.tool_stream import ToolCall, ToolStream, decode_json, new_call_id

CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP = DEEPSEEK_MARKERS
FENCE = "```json"
NAME_MAX = 256
"""The longest header (type or name) a stream waits for before it calls the markup malformed
(it would otherwise hold back all the text after a stray marker)."""

_TYPE = re.compile(r"\s*\w*\s*")
_NAME = re.compile(r"[ \t]*([^\s｜]+)[ \t]*")
_NAME_SO_FAR = re.compile(r"[ \t]*[^\s｜]*[ \t]*")


class DeepSeekStream(ToolStream):
    """The block of calls both formats share; subclasses say what a call's header is."""

    FENCED = False
    """Whether a code fence may come around the arguments (V3's "```json" ... "```")."""
    FIRST = "name"
    """The state after CALL_BEGIN: "type" (V3: a word, then SEP) or "name"."""
    NAME_END = SEP
    """What ends the name: SEP (V3.1) or the end of its line (V3)."""

    def __init__(self) -> None:
        super().__init__()
        self._name = self._args = ""

    def _step(self, final: bool) -> bool:
        buf, state = self._buf, self._state
        if state == "text":
            return self._text_until(CALLS_BEGIN, "block", final)
        if state in ("block", "between"):
            return self._next_call(final)
        if state == "type":
            return self._header(_TYPE, _TYPE, "name", final)
        if state == "name":
            return self._header(_NAME, _NAME_SO_FAR, "args", final)
        if state == "args":
            return self._args_begin(final)
        if state == "object":
            end = self._scan.end(buf)
            if end is None:
                if final:
                    self._fail("text")
                return final
            args = decode_json(buf[:end])
            if not isinstance(args, dict):
                self._fail("text")
            else:
                self._args = json.dumps(args, ensure_ascii=False)
                self._hold(end, "tail")
            return True
        return self._tail(final)

    def _next_call(self, final: bool) -> bool:
        """After CALLS_BEGIN ("block": a call must follow) or after a call ("between")."""
        buf = self._buf
        rest = buf.lstrip()
        if rest.startswith(CALL_BEGIN):
            self._hold(len(buf) - len(rest) + len(CALL_BEGIN), self.FIRST)
        elif self._state == "between" and rest.startswith(CALLS_END):
            self._take(len(buf) - len(rest) + len(CALLS_END))
            self._state = "text"
        elif final and self._state == "between" and rest and CALLS_END.startswith(rest):
            self._take(len(buf))  # (CALLS_END cut off by the end of output)
        elif not final and (CALL_BEGIN.startswith(rest) or self._state == "between" and CALLS_END.startswith(rest)):
            return False  # whitespace, or a marker not yet whole
        elif self._state == "block":
            self._fail("text")  # (a block without a call is no call)
        else:
            self._state = "text"
        return True

    def _header(self, whole: re.Pattern[str], so_far: re.Pattern[str], then: str, final: bool) -> bool:
        """The type or the name, up to its end (SEP, or the name's NAME_END)."""
        buf = self._buf
        end = SEP if self._state == "type" else self.NAME_END
        i = buf.find(end)
        if i < 0:
            head = buf[: len(buf) - partial_tag(buf, end)]  # (the end, if it comes, is after head)
            if final or len(head) > NAME_MAX or not so_far.fullmatch(head):
                self._fail("text")
                return True
            return False
        m = whole.fullmatch(buf, 0, i)
        if m is None or i > NAME_MAX:
            self._fail("text")
            return True
        if self._state == "name":
            self._name = m.group(1)
        self._hold(i + len(end), then)
        return True

    def _args_begin(self, final: bool) -> bool:
        """Up to the arguments' opening brace: whitespace, and V3's optional fence."""
        buf = self._buf
        rest = buf.lstrip()
        if self.FENCED:
            if not final and FENCE.startswith(rest):
                return False  # (also "": the fence or the object may still come)
            for fence in (FENCE, "```"):
                if rest.startswith(fence):
                    rest = rest[len(fence) :].lstrip()
                    break
        if not rest:
            if final:
                self._fail("text")
            return final
        if rest[0] == "{":
            self._hold(len(buf) - len(rest), "object")
        else:
            self._fail("text")
        return True

    def _tail(self, final: bool) -> bool:
        """The call is complete: consume what of its tail comes (each piece optional, after
        optional whitespace), waiting only while the text may still become the next piece."""
        buf, pos = self._buf, 0
        for piece in ("```", CALL_END) if self.FENCED else (CALL_END,):
            rest = buf[pos:].lstrip()
            if rest.startswith(piece):
                pos = len(buf) - len(rest) + len(piece)
            elif piece.startswith(rest):
                if not final:
                    return False
                pos = len(buf)  # (the tail cut off by the end of output)
        self._take(pos)
        self._emit(ToolCall(new_call_id(), self._name, self._args))
        self._state = "between"
        return True


class DeepSeekV3Stream(DeepSeekStream):
    """deepseek_v3: `function<｜tool▁sep｜>NAME` on one line, then the fenced JSON."""

    FENCED = True
    FIRST = "type"
    NAME_END = "\n"


class DeepSeekV31Stream(DeepSeekStream):
    """deepseek_v31: `NAME<｜tool▁sep｜>` then the JSON."""
