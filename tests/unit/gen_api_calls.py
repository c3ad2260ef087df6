#!/usr/bin/env python3
"""Writes a C file that calls every function the installed headers declare, twice: once with
every pointer NULL and every number 0, once with every pointer NULL and every number -1 (for an
unsigned type: its largest value). test_api_null.c runs each call in a child process of its own.

  gen_api_calls.py OUT.c HEADER...

A function is found from its declaration at file scope: `type name(parameters);` or a static
inline definition. The table records whether the function returns fsdpc_status_t and takes a
pointer: such a call must be refused with a status other than STATUS_OK.
"""
import os
import re
import sys


def strip(text):
    """The header without comments, preprocessor lines and extern "C" braces."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    lines = []
    cont = False
    for line in text.split("\n"):
        if cont or line.lstrip().startswith("#"):
            cont = line.rstrip().endswith("\\")
            continue
        lines.append(line)
    text = "\n".join(lines)
    return text.replace('extern "C" {', " ")


def statements(text):
    """File-scope statements: the text up to each ';' or each '{...}' body at depth 0."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == "{":
            if depth == 0:
                head = text[start:i]
                out.append((head, True))
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                start = i + 1
                # a typedef'd struct or enum ends with its name and ';'
                j = text.find(";", i)
                if not re.match(r"\s*;", text[i + 1:]) and re.match(r"\s*\w+\s*;", text[i + 1:]):
                    start = j + 1
                    i = j
        elif c == ";" and depth == 0:
            out.append((text[start:i], False))
            start = i + 1
        i += 1
    return out


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def source_path(header):
    """header's path from the source root, as the library includes it (models/llama/llama.h)."""
    return os.path.relpath(os.path.abspath(header), ROOT)


def split_top(text):
    """text split at the commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for c in text:
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += (c == "(") - (c == ")")
        cur += c
    return parts + [cur]


def prototype(head):
    """(return type, name, parameter text) of a declaration, or None."""
    head = re.sub(r"__attribute__\s*\(\(.*\)\)\s*$", "", head).strip()
    m = re.match(r"^(?P<ret>[\w\s\*]*?[\w\*])\s*\b(?P<name>[a-z_][a-z0-9_]*)\s*\(", head)
    if not m or not head.endswith(")"):
        return None
    return m.group("ret"), m.group("name"), head[m.end():-1]


UNSIGNED = re.compile(r"\b(size_t|uint\d+_t|unsigned|uint64_t|uintptr_t)\b")


def params_of(text):
    text = " ".join(text.split())
    if text in ("", "void"):
        return []
    return [p.strip() for p in split_top(text)]


def param_type(p, pointer_types):
    """(C type, kind): kind is 'ptr', 'unsigned', 'number' or 'struct'."""
    if p == "...":
        return None, "varargs"
    m = re.match(r"^(.*?)(\b[a-z_][a-z0-9_]*)$", p)
    ctype = m.group(1).strip() if m and m.group(1).strip() else p
    if "(" in p or "*" in ctype or ctype.split()[-1] in pointer_types:
        return ctype, "ptr"
    if UNSIGNED.search(ctype):
        return ctype, "unsigned"
    base = ctype.replace("const", "").split()[-1]
    if base in ("int", "long", "int64_t", "int32_t", "double", "float", "bool", "_Bool", "char"):
        return ctype, "number"
    return ctype, "struct"  # a typedef: an enum or a struct by value


def pointer_typedefs(paths):
    """The names of the function pointer types the headers define."""
    names = set()
    for path in paths:
        names |= set(re.findall(r"typedef\s+[^;{}]*\(\s*\*\s*(\w+)\s*\)", strip(open(path).read())))
    return names


def functions(path, pointer_types):
    text = strip(open(path).read())
    found = []
    for head, is_body in statements(text):
        head = " ".join(head.split())
        if head.startswith("typedef") or not head:
            continue
        if is_body and not head.startswith("static"):
            continue
        proto = prototype(head)
        if not proto:
            continue
        ret = proto[0].replace("static", "").replace("inline", "").replace("extern", "").strip()
        params = [param_type(p, pointer_types) for p in params_of(proto[2])]
        found.append((proto[1], " ".join(ret.split()), params))
    return found


def call(name, params, minus_one):
    args = []
    for ctype, kind in params:
        if kind == "varargs":
            continue
        if kind == "ptr":
            args.append("NULL")
        elif kind == "unsigned":
            args.append("(%s)%s" % (ctype, "-1" if minus_one else "0"))
        elif kind == "number":
            args.append("(%s)%s" % (ctype, "-1" if minus_one else "0"))
        else:
            # an enum or struct by value: all bytes 0, or all bytes 0xff
            args.append("*(const %s *)api_value(sizeof(%s), %d, &(%s){0})"
                        % (ctype, ctype, minus_one, ctype))
    return "%s(%s)" % (name, ", ".join(args))


def main():
    out, headers = sys.argv[1], sys.argv[2:]
    rows = []
    pointer_types = pointer_typedefs(headers)
    for h in headers:
        for name, ret, params in functions(h, pointer_types):
            rows.append((h, name, ret, params))
    seen = set()
    body = ["/* Written by gen_api_calls.py: one call per public function and argument set. */",
            "#include <stddef.h>", "#include <string.h>", ""]
    for h in headers:
        body.append('#include "%s"' % source_path(h))
    body += ["", "#include \"api_calls.h\"", "", "#pragma GCC diagnostic ignored \"-Wnonnull\"",
             "#pragma GCC diagnostic ignored \"-Wunused-value\"",
             "#pragma GCC diagnostic ignored \"-Wunused-result\"",
             "#pragma GCC diagnostic ignored \"-Wstringop-overflow\"", "",
             "static const void *api_value(size_t size, int ones, void *buf) {",
             "  memset(buf, ones ? 0xff : 0, size);",
             "  return buf;",
             "}", ""]
    table = []
    for header, name, ret, params in rows:
        if name in seen:
            continue
        seen.add(name)
        takes_ptr = any(k == "ptr" for _, k in params)
        refuses = ret == "fsdpc_status_t" and takes_ptr
        for minus_one in ((0, 1) if params else (0,)):
            fn = "call_%s_%d" % (name, minus_one)
            body.append("static int %s(void) {" % fn)
            if ret == "fsdpc_status_t":
                body.append("  return %s != STATUS_OK;" % call(name, params, minus_one))
            elif ret == "void":
                body.append("  %s;" % call(name, params, minus_one))
                body.append("  return 1;")
            else:
                body.append("  (void)%s;" % call(name, params, minus_one))
                body.append("  return 1;")
            body.append("}")
            table.append('  {"%s", "%s", %d, %d, %s},' % (name, source_path(header),
                                                       minus_one, 1 if refuses else 0, fn))
    body += ["", "const api_call_t api_calls[] = {"] + table + ["};",
             "const int api_call_count = (int)(sizeof api_calls / sizeof api_calls[0]);", ""]
    with open(out, "w") as f:
        f.write("\n".join(body))


if __name__ == "__main__":
    main()
