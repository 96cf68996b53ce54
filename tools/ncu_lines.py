"""Sums an Nsight Compute source-page export (tools/ncu_piece_lines.sh's ncu-<i>-sass.csv: ``ncu
--page source --csv --print-source cuda,sass``) by source line: each line's share of the kernel's
executed warp instructions and of its warp stall samples, most instructions first.

    python tools/ncu_lines.py out/ncu-1-sass.csv [--top 40]
"""
import argparse
import csv


def line_totals(path):
    """[(file, line, source, stall samples, instructions executed)] of the export's source lines."""
    lines, current = [], None
    for row in csv.reader(open(path)):
        if not row:
            continue
        if row[0] == "File Path":
            current = row[1].rsplit("/", 1)[-1]
        elif row[0] not in ("Function Name", "Line No") and row[0] and len(row) > 7 and row[2] == "-":
            lines.append((current, int(row[0]), row[1], int(row[4] or 0), int(row[7] or 0)))
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    lines = line_totals(args.csv)
    samples = sum(x[3] for x in lines) or 1
    instructions = sum(x[4] for x in lines) or 1
    print(f"{instructions} warp instructions, {samples} stall samples")
    for name, line, source, s, i in sorted(lines, key=lambda x: -x[4])[:args.top]:
        print(f"{100 * i / instructions:5.1f}% instr {100 * s / samples:5.1f}% stalls  {name}:{line}  {source[:100]}")


if __name__ == "__main__":
    main()
