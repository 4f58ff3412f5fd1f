"""Chat-format helpers shared by the server and the trainer (they import nothing else of inflight)."""

from inflight.chat.tool_calls import ToolCall, parse_tool_calls

__all__ = ["ToolCall", "parse_tool_calls"]
