"""An agent loop with JSON-schema tool calls: each turn the model must answer with
a JSON object {"tool": ..., "input": ...} (constrained decoding guarantees it
parses), the program runs the tool and feeds the result back, until "finish".

    .venv/bin/python examples/lang_agent_json_tools.py
"""

import ast
import json
import operator

from streamer import LLM
from streamer.lang import EngineBackend, assistant, function, gen, system, user

TOOL_CALL = {
    "type": "object",
    "properties": {
        "tool": {"type": "string", "enum": ["calculator", "lookup", "finish"]},
        "input": {"type": "string", "maxLength": 40},
    },
    "required": ["tool", "input"],
}
FACTS = {"paris": "Paris has about 2.1 million inhabitants.", "everest": "Mount Everest is 8849 m high."}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expr: str) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("only + - * / on numbers")

    try:
        return str(ev(ast.parse(expr, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


def run_tool(call: dict) -> str:
    if call["tool"] == "calculator":
        return calculator(call["input"])
    return next((v for k, v in FACTS.items() if k in call["input"].lower()), "no entry found")


@function
def agent(s, task, max_steps=4):
    s += system(
        "You solve tasks with tools. Reply with one JSON object {\"tool\": ..., \"input\": ...}. "
        "Tools: calculator (arithmetic like 12*7), lookup (a topic), finish (input: the final answer)."
    )
    # one worked example, as earlier turns of the same conversation
    s += user("What is 3 * 4?")
    s += assistant('{"tool": "calculator", "input": "3 * 4"}')
    s += user("Result: 12")
    s += assistant('{"tool": "finish", "input": "12"}')
    s += user(task)
    trace = []
    for step in range(max_steps):
        s += assistant(gen(f"call{step}", max_tokens=48, json_schema=TOOL_CALL))
        call = json.loads(s[f"call{step}"])  # always parses: the output was constrained to the schema
        trace.append(call)
        if call["tool"] == "finish":
            break
        s += user(f"Result: {run_tool(call)}")
    return trace


def main() -> None:
    with LLM("default") as llm:
        st = agent.run("Compute 17 * 23 with the calculator.", backend=EngineBackend(llm))
        for call in st.ret:
            result = run_tool(call) if call["tool"] != "finish" else "(done)"
            print(f"{call['tool']:10} {call['input']!r:40} -> {result}")


if __name__ == "__main__":
    main()
