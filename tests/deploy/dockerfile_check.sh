#!/usr/bin/env bash
# Static checks of deploy/docker/Dockerfile, for machines that cannot build images (no container
# daemon, no registry to pull a base image from). Usage:
#   tests/deploy/dockerfile_check.sh [REPO_ROOT [DOCKERFILE]]
# REPO_ROOT defaults to this script's ../.. and is the build context; DOCKERFILE defaults to
# REPO_ROOT/deploy/docker/Dockerfile. Each failing check prints a line naming it; exit 1 if any
# failed, 0 with a summary line when all passed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="${1:-$here/../..}"
repo="$(cd "$repo" && pwd)"
dockerfile="${2:-$repo/deploy/docker/Dockerfile}"
binaries=(hetpar hetpar-encoder hetpar-llm hetpar-reference)
# Loaded with dlopen by the tokenizer from the binaries' directory (common/data/tokenizer.cc).
modules=(libhetpar_sentencepiece.so)

if [ ! -f "$dockerfile" ]; then
  echo "dockerfile_check: FAIL: dockerfile exists: $dockerfile not found" >&2
  exit 1
fi

failures=0
checks=0
check() {  # check NAME CONDITION-STATUS DETAIL
  checks=$((checks + 1))
  if [ "$2" -ne 0 ]; then
    echo "dockerfile_check: FAIL: $1: $3" >&2
    failures=$((failures + 1))
  fi
}

# One instruction per line: continuation lines joined, comments and blank lines dropped
# (a comment line inside a continuation is dropped too, as Docker does).
instructions="$(awk '
  /^[ \t]*#/ { next }
  { line = $0
    if (line ~ /\\[ \t]*$/) { sub(/\\[ \t]*$/, "", line); buf = buf line " "; next }
    buf = buf line
    if (buf ~ /[^ \t]/) print buf
    buf = "" }
  END { if (buf ~ /[^ \t]/) print buf }' "$dockerfile")"

# Per stage: index, name, and its instructions.
stage=-1
declare -a stage_name=() stage_body=()
while IFS= read -r ins; do
  read -r keyword rest <<< "$ins"
  keyword="${keyword^^}"
  if [ "$keyword" = FROM ]; then
    stage=$((stage + 1))
    read -r -a words <<< "$rest"
    name="$stage"
    for ((i = 0; i < ${#words[@]}; i++)); do
      if [ "${words[$i]^^}" = AS ] && [ $((i + 1)) -lt ${#words[@]} ]; then name="${words[$((i + 1))]}"; fi
    done
    stage_name[stage]="$name"
    stage_body[stage]=""
  elif [ "$stage" -ge 0 ]; then
    stage_body[stage]+="$keyword $rest"$'\n'
  fi
done <<< "$instructions"
nstages=$((stage + 1))

check "at least two FROM stages" "$([ "$nstages" -ge 2 ] && echo 0 || echo 1)" \
  "found $nstages FROM stage(s); expected a build stage and a runtime stage"
[ "$nstages" -ge 1 ] || { echo "dockerfile_check: $failures of $checks checks failed" >&2; exit 1; }

# Sources of a COPY/ADD line (all arguments but the last, options dropped; JSON form too).
copy_sources() {
  local args="$1" a
  local -a words=() srcs=()
  if [[ "$args" =~ ^[[:space:]]*(--[^[:space:]]+[[:space:]]+)*\[ ]]; then
    args="${args#*[}"; args="${args%]*}"; args="${args//,/ }"; args="${args//\"/}"
  fi
  read -r -a words <<< "$args"
  for a in "${words[@]}"; do
    [[ "$a" == --* ]] || srcs+=("$a")
  done
  [ ${#srcs[@]} -ge 2 ] && printf '%s\n' "${srcs[@]:0:${#srcs[@]}-1}"
  return 0
}
copy_dest() {  # the destination (last argument) of a COPY/ADD line, options dropped; JSON form too
  local args="$1" a last=""
  local -a words=()
  if [[ "$args" =~ ^[[:space:]]*(--[^[:space:]]+[[:space:]]+)*\[ ]]; then
    args="${args#*[}"; args="${args%]*}"; args="${args//,/ }"; args="${args//\"/}"
  fi
  read -r -a words <<< "$args"
  for a in "${words[@]}"; do
    [[ "$a" == --* ]] || last="$a"
  done
  echo "$last"
}
copy_from() {  # the --from= value of a COPY line, or nothing
  local w
  for w in $1; do
    case "$w" in --from=*) echo "${w#--from=}"; return 0 ;; --*) ;; *) return 0 ;; esac
  done
}

# The build stage: the one that RUNs deploy/install-deps.sh (else the first).
build=0
for ((s = 0; s < nstages; s++)); do
  if grep -Eq '^RUN .*deploy/install-deps\.sh' <<< "${stage_body[s]}"; then build=$s; break; fi
done
runtime=$((nstages - 1))

# Build stage COPYs deploy/install-deps.sh (itself, its folder or the whole context) before it
# RUNs it.
copied_at=0 run_at=0 n=0
while IFS= read -r ins; do
  n=$((n + 1))
  case "$ins" in
    COPY\ *|ADD\ *)
      rest="${ins#* }"
      [ -n "$(copy_from "$rest")" ] && continue
      while IFS= read -r src; do
        src="${src#./}"; src="${src%/}"
        case "$src" in
          deploy/install-deps.sh|deploy|.|'') [ "$copied_at" -eq 0 ] && copied_at=$n ;;
        esac
      done < <(copy_sources "$rest") ;;
    RUN\ *deploy/install-deps.sh*) [ "$run_at" -eq 0 ] && run_at=$n ;;
  esac
done <<< "${stage_body[build]}"
check "build stage COPYs deploy/install-deps.sh" "$([ "$copied_at" -gt 0 ] && echo 0 || echo 1)" \
  "stage '${stage_name[build]}' has no COPY of deploy/install-deps.sh (or deploy/ or .)"
check "build stage RUNs deploy/install-deps.sh" "$([ "$run_at" -gt 0 ] && echo 0 || echo 1)" \
  "stage '${stage_name[build]}' has no RUN of deploy/install-deps.sh"
if [ "$copied_at" -gt 0 ] && [ "$run_at" -gt 0 ]; then
  check "deploy/install-deps.sh is copied before it runs" "$([ "$copied_at" -lt "$run_at" ] && echo 0 || echo 1)" \
    "in stage '${stage_name[build]}' the RUN comes before the COPY"
fi
check "build and runtime stages differ" "$([ "$build" -ne "$runtime" ] && echo 0 || echo 1)" \
  "deploy/install-deps.sh runs in the last stage; the runtime stage must be a separate, slim one"

# Runtime stage copies each binary (and module) from the build stage.
runtime_sources=()
while IFS= read -r ins; do
  case "$ins" in
    COPY\ *)
      rest="${ins#COPY }"
      from="$(copy_from "$rest")"
      if [ "$from" = "${stage_name[build]}" ] || [ "$from" = "$build" ]; then
        while IFS= read -r src; do runtime_sources+=("$src"); done < <(copy_sources "$rest")
      fi ;;
  esac
done <<< "${stage_body[runtime]}"
for f in "${binaries[@]}" "${modules[@]}"; do
  found=1
  for src in "${runtime_sources[@]+"${runtime_sources[@]}"}"; do
    case "$src" in
      "$f"|*/"$f") found=0 ;;
    esac
  done
  check "runtime stage copies $f from the build stage" "$found" \
    "no 'COPY --from=${stage_name[build]} .../$f' in stage '${stage_name[runtime]}'"
done

# The build links libtorch from the torch wheel in the venv that deploy/install-deps.sh creates;
# the build stage must not skip the venv.
check "build stage installs the Python venv (the torch wheel)" \
  "$(grep -Eq "HETPAR_NO_VENV=[\"']?1" <<< "${stage_body[build]}" && echo 1 || echo 0)" \
  "stage '${stage_name[build]}' sets HETPAR_NO_VENV=1, but the build needs the venv's torch wheel"

# The runtime stage gets the bundled torch libraries: its LD_LIBRARY_PATH names <dir>/torch/lib
# (the binaries' RUNPATH names the build stage's venv), and a COPY from the build stage fills
# <dir> itself, so torch/lib and nvidia/<package>/lib keep the layout that libtorch_cuda.so's
# RPATH ($ORIGIN/../../nvidia/<package>/lib) needs.
ld_path=""
while IFS= read -r ins; do
  case "$ins" in
    ENV\ *)
      read -r -a words <<< "${ins#ENV }"
      if [ ${#words[@]} -ge 2 ] && [ "${words[0]}" = LD_LIBRARY_PATH ]; then
        ld_path="${words[*]:1}"  # ENV KEY VALUE
      else
        for w in "${words[@]}"; do
          case "$w" in LD_LIBRARY_PATH=*) ld_path="${w#LD_LIBRARY_PATH=}" ;; esac
        done
      fi ;;
  esac
done <<< "${stage_body[runtime]}"
ld_path="${ld_path//\"/}"
bundle_dir=""
IFS=: read -r -a entries <<< "$ld_path"
for e in "${entries[@]+"${entries[@]}"}"; do
  e="${e%/}"
  case "$e" in /*/torch/lib) bundle_dir="${e%/torch/lib}"; break ;; esac
done
check "runtime LD_LIBRARY_PATH names a bundled torch/lib" "$([ -n "$bundle_dir" ] && echo 0 || echo 1)" \
  "stage '${stage_name[runtime]}' has no ENV LD_LIBRARY_PATH with an absolute <dir>/torch/lib entry (LD_LIBRARY_PATH='$ld_path')"
if [ -n "$bundle_dir" ]; then
  copied=1
  while IFS= read -r ins; do
    case "$ins" in COPY\ *) ;; *) continue ;; esac
    rest="${ins#COPY }"
    from="$(copy_from "$rest")"
    { [ "$from" = "${stage_name[build]}" ] || [ "$from" = "$build" ]; } || continue
    dest="$(copy_dest "$rest")"
    [ "${dest%/}" = "$bundle_dir" ] && copied=0
  done <<< "${stage_body[runtime]}"
  check "runtime stage copies the bundled libraries to $bundle_dir" "$copied" \
    "no 'COPY --from=${stage_name[build]} <folder> $bundle_dir/' in stage '${stage_name[runtime]}', whose LD_LIBRARY_PATH names $bundle_dir/torch/lib"
fi

# The runtime stage runs as a non-root user.
user="$(grep -E '^USER ' <<< "${stage_body[runtime]}" | tail -n 1 | sed 's/^USER[[:space:]]*//; s/[[:space:]]*$//')" || true
uid="${user%%:*}"
if [ -z "$user" ]; then
  check "runtime USER is non-root" 1 "stage '${stage_name[runtime]}' has no USER (it would run as root)"
elif [[ "$uid" == *'$'* ]]; then
  check "runtime USER is non-root" 1 "USER '$user' uses a variable; cannot tell it is not root"
else
  check "runtime USER is non-root" "$([ "$uid" != root ] && [ "$uid" != 0 ] && echo 0 || echo 1)" \
    "USER is '$user'"
fi

# Every path COPY/ADD takes from the build context exists and is not excluded by .dockerignore.
ignore_patterns=()
if [ -f "$repo/.dockerignore" ]; then
  while IFS= read -r p; do
    p="${p%%#*}"; p="${p#"${p%%[![:space:]]*}"}"; p="${p%"${p##*[![:space:]]}"}"
    [ -z "$p" ] && continue
    [[ "$p" == '!'* ]] && continue
    p="${p#/}"; p="${p%/}"
    ignore_patterns+=("$p")
  done < "$repo/.dockerignore"
fi
context_copies=0
for ((s = 0; s < nstages; s++)); do
  while IFS= read -r ins; do
    case "$ins" in COPY\ *|ADD\ *) ;; *) continue ;; esac
    rest="${ins#* }"
    [ -n "$(copy_from "$rest")" ] && continue
    while IFS= read -r src; do
      context_copies=$((context_copies + 1))
      if [[ "$src" == *://* ]]; then
        check "COPY source $src is in the repository" 1 "a URL; the image must build from the repository alone"
        continue
      fi
      rel="${src#./}"; rel="${rel%/}"; [ -z "$rel" ] && rel=.
      # The source may be a glob: expand it in the repository.
      mapfile -t matches < <(cd "$repo" || exit 0; compgen -G "$rel" || true)
      check "COPY source $src exists in the repository" "$([ ${#matches[@]} -gt 0 ] && echo 0 || echo 1)" \
        "stage '${stage_name[s]}': $repo/$rel not found"
      if [ "$rel" != . ]; then
        excluded=1
        for p in "${ignore_patterns[@]+"${ignore_patterns[@]}"}"; do
          # shellcheck disable=SC2053 # $p is a glob pattern on purpose
          if [[ "$rel" == $p || "$rel" == $p/* ]]; then excluded=0; break; fi
        done
        check "COPY source $src is not excluded by .dockerignore" "$((1 - excluded))" \
          "stage '${stage_name[s]}': .dockerignore pattern '${p:-}' excludes it"
      fi
    done < <(copy_sources "$rest")
  done <<< "${stage_body[s]}"
done
check "the Dockerfile COPYs from the build context" "$([ "$context_copies" -gt 0 ] && echo 0 || echo 1)" \
  "no COPY/ADD without --from"

# The image has a default command.
check "runtime stage has a CMD or ENTRYPOINT" \
  "$(grep -Eq '^(CMD|ENTRYPOINT) ' <<< "${stage_body[runtime]}" && echo 0 || echo 1)" \
  "stage '${stage_name[runtime]}' has neither"

if [ "$failures" -gt 0 ]; then
  echo "dockerfile_check: $failures of $checks checks failed ($dockerfile)" >&2
  exit 1
fi
echo "dockerfile_check: all $checks checks passed ($dockerfile)"
