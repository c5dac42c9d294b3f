"""Tables as Markdown or LaTeX.

A table of text cells (a header first, the (row, column) cells to set in bold) as Markdown
or LaTeX; the terminal draws the same rows (posbench/console.py)."""

from __future__ import annotations

import re

LATEX = {
    "\\": "\\textbackslash{}",
    "_": "\\_",
    "%": "\\%",
    "&": "\\&",
    "#": "\\#",
    "$": "\\$",
    "{": "\\{",
    "}": "\\}",
    "^": "\\textasciicircum{}",
    "~": "\\textasciitilde{}",
    "±": "$\\pm$",
    "—": "--",
}


def tex(text: str) -> str:
    """Text set literally in LaTeX: each special character replaced in one pass, so that no
    replacement is replaced again."""
    return re.sub("|".join(map(re.escape, LATEX)), lambda m: LATEX[m.group()], text)


def markdown_table(rows: list[list[str]], best: set) -> list[str]:
    """A Markdown table, best cells in bold."""
    marked = [[f"**{c}**" if (i, j) in best and c else c for j, c in enumerate(r)] for i, r in enumerate(rows)]
    return ["| " + " | ".join(marked[0]) + " |", "|" + "---|" * len(marked[0])] + [
        "| " + " | ".join(r) + " |" for r in marked[1:]
    ]


def latex_table(rows: list[list[str]], best: set, caption: str) -> list[str]:
    """A booktabs table, ready to \\input: every cell escaped, best cells in bold."""
    cells = [
        [f"\\textbf{{{tex(c)}}}" if (i, j) in best and c else tex(c) for j, c in enumerate(r)]
        for i, r in enumerate(rows)
    ]
    return [
        "\\begin{table}[t]",
        "\\centering",
        f"\\begin{{tabular}}{{l{'r' * (len(cells[0]) - 1)}}}",
        "\\toprule",
        " & ".join(cells[0]) + " \\\\",
        "\\midrule",
        *(" & ".join(r) + " \\\\" for r in cells[1:]),
        "\\bottomrule",
        "\\end{tabular}",
        f"\\caption{{{caption}}}",
        "\\end{table}",
        "",
    ]


def transposed(rows: list[list[str]], best: set, corner: str = "length") -> tuple[list[list[str]], set]:
    """Lengths as rows, schemes as columns."""
    out = [list(col) for col in zip(*rows)]
    out[0][0] = corner
    return out, {(j, i) for i, j in best}
