#!/usr/bin/env bash
# Fails when an #include crosses a forbidden direction (docs/architecture.md, "Folders and
# targets"). Folders depend downwards only: server -> runtime -> actors -> messages -> model;
# inside model/, the rooms depend downwards only as the table below says; headers internal to
# model/ (kernels, loaders, weights) are never included above it; no file includes a tensor
# library (strata has none: docs/architecture.md, "Threads").
# Usage: tests/layout/check_includes.sh [REPO_ROOT]   (prints every violation, exit 1 if any)
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/../.." && pwd)}"
cd "$root"

# room -> the rooms its files may include (itself included). The longest matching room wins.
declare -A allowed=(
  [model/base]="model/base"
  [model/text/jinja]="model/text/jinja"
  [model/text]="model/text model/text/jinja model/formats model/base"
  [model/formats]="model/formats model/base"
  [model/kernels]="model/kernels model/formats model/base"
  [model/transformer]="model/transformer model/kernels model/formats model/base"
  [messages]="messages model"
  [actors]="actors messages model"
  [runtime]="runtime actors messages model"
  [server]="server runtime actors messages model"
  [examples]="runtime actors messages model"
  # The `strata` executable (not the strata_runtime library) wires `serve` in from server/.
  [runtime/main.cpp]="server runtime actors messages model"
)
# Headers internal to model/ (one room's inner workings, or the weights' layout).
internal='^model/(base/parallel|formats/(source|wmatrix)|kernels/[a-z_]+|transformer/(shard_impl|weights)|text/(tokenizer_impl|tokenizer_hf_parts)|text/jinja/(ast|builtins))\.hpp$'

room_of() { # path -> its room (the longest key of `allowed` that prefixes it), or ""
  local f="$1" best=""
  if [ -n "${allowed[$f]+x}" ]; then printf '%s' "$f"; return; fi
  for r in "${!allowed[@]}"; do
    if [[ "$f" == "$r/"* ]] && [ ${#r} -gt ${#best} ]; then best="$r"; fi
  done
  printf '%s' "$best"
}

bad=0
checked=0
while IFS= read -r file; do
  from="$(room_of "$file")"
  [ -n "$from" ] || continue # tests/, scripts/ ...: anything goes
  checked=$((checked + 1))
  while IFS=: read -r line inc; do
    if [[ "$inc" =~ \#include\ \"([^\"]+)\" ]]; then
      target="${BASH_REMATCH[1]}"
      to="$(room_of "$target")"
      [ -n "$to" ] || continue
      ok=0
      for r in ${allowed[$from]}; do
        if [ "$to" = "$r" ] || [[ "$to" == "$r/"* && "$r" == model ]]; then ok=1; fi
      done
      if [ $ok = 0 ]; then
        echo "$file:$line: $from may not include $target ($to); allowed: ${allowed[$from]}"; bad=1
      fi
      if [[ "$from" != model/* && "$target" =~ $internal ]]; then
        echo "$file:$line: $target is internal to model/"; bad=1
      fi
    elif [[ "$inc" =~ \#include\ \<(ATen|torch|c10)/ ]]; then
      echo "$file:$line: strata does not use a tensor library (${inc#*#include })"; bad=1
    fi
  done < <(grep -n '^[[:space:]]*#[[:space:]]*include' "$file" | sed 's/^\([0-9]*\):[[:space:]]*#[[:space:]]*include[[:space:]]*/\1:#include /')
done < <(find model messages actors runtime server examples -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' \) | sort)

if [ $bad = 0 ]; then
  echo "include directions: $checked files checked, no violation"
fi
exit $bad
