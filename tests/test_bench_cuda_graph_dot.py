"""The benches' count of kernels a decode step launches, read from the CUDA graph dumps MLX
writes (bench/cuda_graph_dot.py): both dump forms, child graphs flattened and counted once per
inclusion, non-work nodes left out, and the launch shape cut from a kernel's name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "bench" / "cuda_graph_dot.py"
_SPEC = importlib.util.spec_from_file_location("cuda_graph_dot", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
dot = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("cuda_graph_dot", dot)  # its dataclasses look their module up
_SPEC.loader.exec_module(dot)

# flags 0, as MLX prints: a root graph with two kernels and a child graph (a captured cuBLAS
# call) included twice; the child holds one kernel and one memset.
PLAIN = '''digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="bold" shape="octagon" label="0
_ZN3mlx4core2cu13rms_norm_smallEv
"];
"graph_1_node_1"[style="solid" shape="rectangle" label="1
graph_2
"];
"graph_1_node_2"[style="solid" shape="rectangle" label="2
graph_2
"];
"graph_1_node_3"[style="bold" shape="octagon" label="3
_ZN3mlx4core2cu6argmaxEv
"];
"graph_1_node_4"[style="solid" shape="ellipse" label="4
EMPTY
"];
"graph_1_node_0" -> "graph_1_node_1" [headlabel=0];
}
subgraph cluster_2 {
label="graph_2" graph[style="dashed"];
"graph_2_node_0"[style="bold" shape="octagon" label="0
sm90_xmma_gemm_bf16bf16
"];
"graph_2_node_1"[style="solid" shape="invtrapezium" label="1
MEMSET
"];
}
}
'''

# the verbose form: the type leads the label, the launch shape follows the name
VERBOSE = r'''digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="bold" shape="record" label="{KERNEL
| {ID | 0 (topoId: 3) | _Z6rms_normPf\<\<\<1,256,0\>\>\>}
| {cooperative | 0}
}"];
"graph_1_node_1"[style="solid" shape="record" label="{
MEMCPY
| {{ID | node handle} | {1 | 0x0}}
}"];
"graph_1_node_2"[style="solid" shape="record" label="{EMPTY
| {ID | 2}
}"];
"graph_1_node_3"[style="bold" shape="record" label="{KERNEL
| {ID | 3 (topoId: 0) | _Z6rms_normPf\<\<\<1,256,0\>\>\>}
}"];
}
}
'''


def test_flags_zero_dump_flattens_child_graphs_per_inclusion() -> None:
    launches = dot.parse(PLAIN).launches()
    assert launches == {"_ZN3mlx4core2cu13rms_norm_smallEv": 1, "_ZN3mlx4core2cu6argmaxEv": 1,
                        "sm90_xmma_gemm_bf16bf16": 2, "MEMSET": 2}
    assert dot.parse(PLAIN).roots() == ["graph_1"]
    assert dot.kernels(launches) == 4  # the fills are no kernels, the empty node nothing


def test_verbose_dump_counts_work_nodes_only() -> None:
    launches = dot.parse(VERBOSE).launches()
    assert launches == {"_Z6rms_normPf": 2, "MEMCPY": 1}


def test_files_add_up_and_a_dump_without_nodes_counts_nothing(tmp_path: Path) -> None:
    (tmp_path / "graph_1.dot").write_text(PLAIN)
    (tmp_path / "graph_2.dot").write_text(VERBOSE)
    (tmp_path / "graph_3.dot").write_text("digraph dot {\n}\n")
    total = dot.count_launches(sorted(tmp_path.glob("graph_*.dot")))
    assert sum(total.values()) == 6 + 3 and dot.kernels(total) == 4 + 2
    assert total["_Z6rms_normPf"] == 2
