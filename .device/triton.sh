# On the H200 machine, in four consecutive runs on one warm machine: `bash .device/triton.sh N` with .triN carried
# (N = 1..4). The fourth joins the parts, checks the wheel's sha256 and installs it into /tmp/tri371.
set -euo pipefail
N=$1
mkdir -p /tmp/tri && cp ".tri$N"/* /tmp/tri/
if [[ "$N" == 4 ]]; then
    WHEEL=/tmp/tri/triton-3.7.1-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
    cat /tmp/tri/part00 /tmp/tri/part01 /tmp/tri/part02 /tmp/tri/part03 > "$WHEEL"
    echo "7e40869937a68206ec70d7f25bb7ec6433cb083f9135e1f36dbd318dc449a728  $WHEEL" | sha256sum -c -
    python3 -m pip install -q --no-index --no-deps --target /tmp/tri371 "$WHEEL"
fi
ls /tmp/tri
