#!/usr/bin/env python3
"""SASS instruction counts of cubin kernels, without cuobjdump or nvdisasm.

usage: sass_budget.py BUDGET.cubin PROBE.cubin

Each SASS instruction on sm_80/sm_90 is 16 bytes; its low 9 bits name the operation (bits 9-11
choose the operand form: register, immediate, constant). PROBE.cubin holds kernels `probe_<OP>`
that each repeat one known PTX operation 64 times (sass_budget.sh writes them), so the opcode
with about that count in a probe names its operation for this toolkit; opcodes no probe names are
printed as hex. For BUDGET.cubin (sass_budget.cu) it prints each kernel's instruction count and
mix, and the ZipFusion loaders' cost over the bf16 loader's per stored element.
"""
import collections
import struct
import sys


def kernels(path):
    data = open(path, 'rb').read()
    if data[:4] != b'\x7fELF':
        sys.exit(f'{path}: not an ELF file')
    shoff = struct.unpack_from('<Q', data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', data, 0x3A)
    secs = [struct.unpack_from('<IIQQQQ', data, shoff + i * shentsize) for i in range(shnum)]
    strtab = secs[shstrndx][4]
    for name, _typ, _flags, _addr, offset, size in secs:
        raw = data[strtab + name:]
        section = raw[:raw.index(b'\0')].decode()
        if section.startswith('.text.'):
            codes = [struct.unpack_from('<Q', data, offset + i)[0] & 0x1FF for i in range(0, size, 16)]
            yield section[len('.text.'):], size // 16, collections.Counter(codes), codes[-1]


def calibrate(probe_path):
    """Opcode -> name: each probe repeats its operation 64 times (32 for adds, which ptxas pairs
    into IADD3), so its opcode is the one whose count is nearest that; kernels end in NOP padding."""
    names = {}
    for name, _total, ops, last in kernels(probe_path):
        names[last] = 'NOP'
        if 'probe_' not in name:
            continue
        op = name.split('probe_')[1]
        want = 32 if op == 'IADD3' else 64
        code, count = min(ops.items(), key=lambda item: abs(item[1] - want))
        if abs(count - want) <= want // 8:
            names[code] = op
    return names


def short(name):
    for key in ('BudgetKeyBlock', 'BudgetValueBlock', 'BudgetEmpty'):
        if key in name:
            kind = 'ZipFusion' if 'ZfTensors' in name else 'bf16' if 'Bf16' in name else ''
            width = name.split('ELi')[1].split('E')[0] if 'ELi' in name and kind == 'ZipFusion' else ''
            role = {'BudgetKeyBlock': 'K (QK)', 'BudgetValueBlock': 'V (PV)', 'BudgetEmpty': 'empty'}[key]
            return f'{kind} {role}' + (f', w={width}' if width else '')
    return None


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    names = calibrate(sys.argv[2])
    rows = {}
    for name, total, ops, _last in kernels(sys.argv[1]):
        label = short(name)
        if label:
            rows[label] = (total, ops)
    print('| kernel (one warp, one 16-token block) | SASS instructions | mix |')
    print('|---|---:|---|')
    for label in sorted(rows, key=lambda x: (x.split()[0] != 'empty', x)):
        total, ops = rows[label]
        mix = ', '.join(f'{names.get(code, hex(code))} {n}' for code, n in ops.most_common(8))
        print(f'| {label} | {total} | {mix} |')
    print()
    for role in ('K (QK)', 'V (PV)'):
        base = rows.get(f'bf16 {role}')
        for label, (total, _ops) in sorted(rows.items()):
            if base and label.startswith('ZipFusion ' + role):
                extra = total - base[0]
                print(f'{label}: {extra} more than bf16 per warp per block = '
                      f'{extra * 32 / 2048:.2f} thread instructions per element')


if __name__ == '__main__':
    main()
