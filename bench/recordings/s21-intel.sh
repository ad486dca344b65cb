#!/bin/bash
# Recording 20 (bench/RESULTS.md): the Intel Xeon VM of session 21, after the x4 kernels' paired q16 planes
cd "$(dirname "$0")/../.."
P=$(pgrep -f "kv-pareto-journal" | tr '\n' ' ')
[ -n "$P" ] && kill -STOP $P
D=bench/results/s21-intel
echo "start $(date) load $(cat /proc/loadavg)"
PYTHONPATH=src .venv/bin/python bench/x4_rows.py --rows 1,2,3,4,5,6,8 > $D/x4-rows.json
echo "x4 rows done $(date) load $(cat /proc/loadavg)"
.venv/bin/bytediet bench --threads 2 --parts single --peers llama.cpp --json --out $D/single-smollm2.json > /dev/null
echo "single done $(date) load $(cat /proc/loadavg)"
.venv/bin/bytediet bench --threads 2 --parts speculative --peers llama.cpp --json --out $D/speculative-smollm2.json > /dev/null
echo "speculative done $(date) load $(cat /proc/loadavg)"
PYTHONPATH=src .venv/bin/python bench/server_load.py --system both --clients 1,4,16,64 --requests 10 --max-tokens 32 --threads 2 --plot $D/server-load.png --json > $D/server-load.json
echo "serve smollm2 done $(date) load $(cat /proc/loadavg)"
[ -n "$P" ] && kill -CONT $P
echo "all done $(date)"
# then, after the K-quant x4 kernels' paired planes (7b40ff6), Gemma-3:
#   .venv/bin/bytediet bench --threads 2 --model gemma3-270m --parts single --peers llama.cpp --json --out $D/single-gemma3.json
#   .venv/bin/bytediet bench --threads 2 --model gemma3-270m --parts speculative --peers llama.cpp --json --out $D/speculative-gemma3.json
#   PYTHONPATH=src .venv/bin/python bench/server_load.py --model gemma3-270m --system both --clients 1,4,16,64 --requests 10 --max-tokens 32 --threads 2 --plot $D/server-load-gemma3.png --json > $D/server-load-gemma3.json
