# Sourced by scripts/slurm/submit-pipeline and scripts/cron/nightly: one way to configure batch pipelines.
# A config file holds `key = value` lines (# starts a comment at a line start or after a space); `--config FILE`
# reads it, then every `--some-key VALUE` flag overrides `some_key`. Unknown keys are an error (a typo must not
# silently fall back to a default). The caller declares the known keys with their defaults:  declare -A CONF=([key]=default ...)
# and the value-less flags in CONFIG_FLAGS (e.g. CONFIG_FLAGS=(dry_run)); a flag sets its key to 1.

config_die() {
    echo "${CONFIG_PROG:-$0}: $*" >&2
    exit 2
}

config_set() { # KEY VALUE WHERE
    [[ -v CONF[$1] ]] || config_die "$3: unknown key '$1' (known: $(printf '%s\n' "${!CONF[@]}" | sort | tr '\n' ' '))"
    CONF[$1]=$2
}

config_read_file() { # FILE
    local file=$1 line n=0
    [ -f "$file" ] && [ -r "$file" ] || config_die "config file $file: not a readable file"
    while IFS= read -r line || [ -n "$line" ]; do
        n=$((n + 1))
        [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
        [[ $line =~ ^[[:space:]]*([a-z_][a-z0-9_]*)[[:space:]]*=[[:space:]]*(.*)$ ]] ||
            config_die "$file:$n: expected 'key = value', got: $line"
        local key=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
        [[ $value =~ ^(.*[^[:space:]]|)[[:space:]]+#.*$|^#.*$ ]] && value=${BASH_REMATCH[1]}
        value=${value%"${value##*[![:space:]]}"}
        config_set "$key" "$value" "$file:$n"
    done <"$file"
}

config_is_flag() { # KEY
    local flag
    for flag in "${CONFIG_FLAGS[@]}"; do [ "$flag" = "$1" ] && return 0; done
    return 1
}

config_parse() { # "$@" of the script: --config FILE first, then flags in order
    local args=("$@") i key
    for ((i = 0; i < ${#args[@]}; i++)); do
        if [ "${args[i]}" = --config ]; then
            [ $((i + 1)) -lt ${#args[@]} ] || config_die "--config needs a file"
            config_read_file "${args[i + 1]}"
        fi
    done
    while [ $# -gt 0 ]; do
        case $1 in
            --config) shift 2 ;;
            -h | --help) usage; exit 0 ;;
            --*=*) key=${1%%=*}; key=${key#--}; config_set "${key//-/_}" "${1#*=}" "option ${1%%=*}"; shift ;;
            --*)
                key=${1#--}; key=${key//-/_}
                if config_is_flag "$key"; then
                    config_set "$key" 1 "option $1"; shift
                else
                    [ $# -ge 2 ] || config_die "option $1 needs a value"
                    config_set "$key" "$2" "option $1"; shift 2
                fi
                ;;
            *) config_die "unexpected argument '$1' (see --help)" ;;
        esac
    done
}

config_require() { # KEY... : each must be non-empty
    local key
    for key in "$@"; do
        [ -n "${CONF[$key]}" ] || config_die "'$key' is not set (config file key '$key' or option --${key//_/-})"
    done
}

config_abspath() { # KEY... : make path values absolute (jobs and cron do not start in the caller's folder)
    local key
    for key in "$@"; do
        [ -z "${CONF[$key]}" ] || CONF[$key]=$(realpath -m -- "${CONF[$key]}")
    done
}
