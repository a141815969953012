"""The corpus of hostile strings every output boundary (b70ctl.escaping) is tested against, in one place, grouped
by what each string tries: take over a terminal, forge or cut a Markdown document, break out of HTML, break a line,
climb out of a directory. A server's answer, a host fact, a reference file, a recipe field or a directory name
can hold any of them; each test feeds every group to every boundary, since a string made for one output can land
in another."""

from __future__ import annotations

ESC = "\x1b"

TERMINAL = {
    "osc-unterminated": f"0.32.0{ESC}]0;owned",
    "osc-unterminated-at-end": f"model{ESC}]",
    "osc-52-clipboard": f"ok{ESC}]52;c;cm0gLXJmIH4K{ESC}\\ after",
    "osc-0-retitle-bel": f"{ESC}]0;retitled\x07text",
    "osc-8-hyperlink": f"{ESC}]8;;http://evil.example/{ESC}\\click{ESC}]8;;{ESC}\\",
    "csi-cursor-up-erase": f"line{ESC}[2A{ESC}[2Kreplaced",
    "csi-clear-screen": f"{ESC}[2J{ESC}[Hclean",
    "csi-private-mode": f"{ESC}[?1049hhidden screen",
    "sgr-conceal": f"{ESC}[8minvisible{ESC}[0m",
    "dcs-unterminated": f"x{ESC}Pq#0;2;0;0;0",
    "lone-esc-at-end": f"tail{ESC}",
    "esc-before-markup": f"value{ESC}[",
    "c1-csi": "x\x9b2Jy",
    "c1-osc": "x\x9d0;title\x9cy",
    "bel-backspace": "ring\x07\x08\x08\x08gone",
    "carriage-return-overwrite": "FAIL\rPASS",
    "nul": "a\x00b",
    "bidi-override": "abc\u202edcb",
    "bidi-isolate": "x\u2066hidden\u2069y",
}

MARKDOWN = {
    "forged-headline": "0.32.0\n\n**All checks passed.** Claims met: 9 of 9.\n\n",
    "forged-verdict-table": "x |\n| claim | met |\n|---|---|\n| all | ✅ met |",
    "heading": "# All checks passed",
    "setext-heading": "passed\n===",
    "blockquote": "> quoted",
    "list-item": "- [x] done",
    "ordered-list": "1. first",
    "emphasis": "**bold** _it_ ~~struck~~",
    "link": "[click](http://evil.example/)",
    "javascript-link": "[report](javascript:alert(1))",
    "image": "![x](http://evil.example/pixel.png)",
    "reference-link": "[x][1]\n\n[1]: http://evil.example/",
    "autolink": "<http://evil.example/>",
    "raw-html-img": '<img src=x onerror="alert(1)">',
    "html-comment": "<!-- the rest is hidden",
    "html-block": "<div>\n\n**forged**\n\n</div>",
    "entity": "&lt;script&gt; &#x3C;b&#x3E;",
    "code-span-breakout": "`` ` ``x`y",
    "code-fence": "```\nfake block\n```",
    "tilde-fence": "~~~\nfake\n~~~",
    "table-pipe": "a | b | c",
    "backslash-at-end": "trailing\\",
    "math": "$\\mathrm{x}$",
    "indented-code": "\n    code",
    "footnote": "[^1]\n\n[^1]: forged",
}

HTML = {
    "close-cell-script": "</td><script>alert(1)</script>",
    "attribute-breakout": '" onmouseover="alert(1)',
    "single-quote-breakout": "' onfocus='alert(1)",
    "svg-breakout": "</title></svg><script>alert(2)</script>",
    "cdata": "<![CDATA[x]]>",
    "style": "<style>body{display:none}</style>",
    "javascript-url": "javascript:alert(document.domain)",
}

LINE_BREAKS = {
    "lf": "a\nb",
    "crlf": "a\r\nb",
    "cr": "a\rb",
    "vertical-tab": "a\x0bb",
    "form-feed": "a\x0cb",
    "nel": "a\x85b",
    "line-separator": "a\u2028b",
    "paragraph-separator": "a\u2029b",
}

PATHS = {
    "parent": "..",
    "climb": "../../x",
    "absolute": "/abs/dir",
    "hidden": ".hidden",
    "inner-separator": "a/b",
    "backslash": "a\\b",
    "empty": "",
    "nul": "a\x00b",
    "dot": ".",
    "tilde": "~",
    "option-like": "-rf",
    "too-long": "w" * 300,
    "space": "a b",
    "newline": "a\nb",
    "dots-inside": "a..b",
}

GROUPS: dict[str, dict[str, str]] = {"terminal": TERMINAL, "markdown": MARKDOWN, "html": HTML,
                                     "line-breaks": LINE_BREAKS, "paths": PATHS}
# Every string of every group, by "group/name".
ALL: dict[str, str] = {f"{group}/{name}": value for group, members in GROUPS.items() for name, value in members.items()}
# Names that are usable as a path part: the path boundary must keep them.
GOOD_PATH_PARTS = ("short", "acceptance_friendly", "long-prompt", "w1.v2", "A9")
