"""Counts collectives inside the layers' loop of a compiled program's HLO text."""

import re


def collectives_in_layer_loop(hlo: str) -> dict:
    """Collective ops in the body of the layers' while loop (nn.scan), nested calls included."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if m:
            cur = comps.setdefault(m.group(1), [])
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            cur.append(line)
    loops = [ln for body in comps.values() for ln in body  # loops inside it end differently
             if " while(" in ln and re.search(r'op_name="[^"]*/Llama/while"', ln)]
    assert len(loops) == 1, f"expected one layer loop, found {len(loops)}"
    seen, todo = set(), [re.search(r"body=%([\w.\-]+)", loops[0]).group(1)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for ln in comps[name]:
            todo += re.findall(r"(?:calls|to_apply|body|condition|true_computation|"
                               r"false_computation)=%([\w.\-]+)", ln)
            for grp in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", ln):
                todo += re.findall(r"%([\w.\-]+)", grp)
    counts = {}
    for name in seen:
        for ln in comps[name]:
            m = re.search(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|"
                          r"collective-permute)(?:-start)?\(", ln)
            if m:
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts
