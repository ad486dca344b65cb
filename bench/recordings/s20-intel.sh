#!/bin/bash
# Recording 19 (bench/RESULTS.md): the Intel Xeon VM of session 20
# again with the library as built from the tree (the earlier runs' cached library was an experiment's: x4 at every batch)
cd "$(dirname "$0")/../.."
P=$(pgrep -f "kv-pareto-journal" | tr '\n' ' ')
[ -n "$P" ] && kill -STOP $P
D=bench/results/s20-intel
echo "start $(date) load $(cat /proc/loadavg)"
.venv/bin/bytediet bench --threads 2 --parts roofline --roofline-batches 1,16 --peers none --json --out $D/roofline.json > /dev/null
echo "roofline done $(date) load $(cat /proc/loadavg)"
PYTHONPATH=src .venv/bin/python bench/server_load.py --system both --clients 1,4,16,64 --requests 10 --max-tokens 32 --threads 2 --plot $D/server-load.png --json > $D/server-load.json
echo "serve smollm2 done $(date) load $(cat /proc/loadavg)"
PYTHONPATH=src .venv/bin/python bench/server_load.py --model gemma3-270m --system both --clients 1,4,16,64 --requests 10 --max-tokens 32 --threads 2 --plot $D/server-load-gemma3.png --json > $D/server-load-gemma3.json
echo "serve gemma done $(date) load $(cat /proc/loadavg)"
[ -n "$P" ] && kill -CONT $P
echo "all done $(date)"
# then (Recording 19's single-stream and chat rows):
#   .venv/bin/bytediet bench --threads 2 --parts single --peers llama.cpp --json --out $D/single-smollm2.json
#   .venv/bin/bytediet bench --threads 2 --model gemma3-270m --parts single --peers llama.cpp --json --out $D/single-gemma3.json
#   for m in default gemma3-270m; do for sys in bytediet+tiers llama-server; do
#     PYTHONPATH=src .venv/bin/python bench/chat_prefix_load.py --model $m --system $sys --threads 2 --kv-cache-dtype bf16 --json > $D/chat-$m-$sys.json
#   done; done
