"""The math-verify worker program: reads one JSON request per line on stdin, answers one JSON line on stdout.

Run by `posttrain.verify.math_worker` as its own process, so a comparison that never ends (a power tower, an
adversarial expression) is killed from outside instead of hanging a trainer thread, and so math-verify's
signal-based timeouts (main thread only) are never needed. Only LaTeX extraction is used: math-verify's plain
expression parser goes through sympy's ``parse_expr``, which evaluates Python, and model text never reaches it.
Request: {"reference": str, "answer": str, "rational": [p, q] | null}. Reply: {"equal": bool} or {"error": str}.
Several comparisons in one request (the items of a solution set, under one timeout):
{"pairs": [[reference, answer, [p, q] | null], ...]}. Reply: {"equal": [bool, ...]}.
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

    def equal(reference: str, answer: str, rational: list | None) -> bool:
        gold = parse("$" + reference + "$", extraction_config=config, parsing_timeout=None)
        guess = parse("$" + answer + "$", extraction_config=config, parsing_timeout=None)
        same = bool(gold) and bool(guess) and verify(gold, guess, timeout_seconds=None)
        if same and rational:
            # math-verify rounds numbers; a rational reference must match exactly
            exact = sympy.Rational(int(rational[0]), int(rational[1]))
            same = any(isinstance(e, sympy.Basic) and sympy.simplify(e - exact) == 0 for e in guess)
        return bool(same)

    def safe_equal(reference: str, answer: str, rational: list | None) -> bool:
        try:
            return equal(reference, answer, rational)
        except Exception:  # noqa: BLE001 - math-verify could not compare this pair: different
            return False

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if "pairs" in request:
                reply = {"equal": [safe_equal(str(r), str(a), q) for r, a, q in request["pairs"]]}
            else:
                reply = {"equal": equal(request["reference"], request["answer"], request.get("rational"))}
        except Exception as error:  # noqa: BLE001 - reported, the worker lives on
            reply = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
