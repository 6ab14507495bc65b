"""The math-verify worker program: reads one JSON request per line on stdin, answers one JSON line on stdout.

Run by `posttrain.verify.math_worker` as its own process, so a comparison that never ends (a power tower, an
adversarial expression) is killed from outside instead of hanging a trainer thread, and so math-verify's
signal-based timeouts (main thread only) are never needed. Only LaTeX extraction is used: math-verify's plain
expression parser goes through sympy's ``parse_expr``, which evaluates Python, and model text never reaches it.
Request: {"reference": str, "answer": str, "rational": [p, q] | null}. Reply: {"equal": bool} or {"error": str}.
"""

import json
import logging
import resource
import sys
import warnings


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a blow-up fails here, not on the host
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    import sympy
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig()]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            gold = parse("$" + request["reference"] + "$", extraction_config=config, parsing_timeout=None)
            guess = parse("$" + request["answer"] + "$", extraction_config=config, parsing_timeout=None)
            equal = bool(gold) and bool(guess) and verify(gold, guess, timeout_seconds=None)
            if equal and request.get("rational"):
                # math-verify rounds numbers; a rational reference must match exactly
                p, q = request["rational"]
                exact = sympy.Rational(int(p), int(q))
                equal = any(isinstance(e, sympy.Basic) and sympy.simplify(e - exact) == 0 for e in guess)
            reply = {"equal": bool(equal), "parsed": [str(g) for g in guess[:1]]}
        except Exception as error:  # noqa: BLE001 - reported, the worker lives on
            reply = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
