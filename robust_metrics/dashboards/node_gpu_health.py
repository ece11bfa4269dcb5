"""The "Node and GPU health" dashboard: GPUs, NICs and the sidecar of the nodes a run uses."""

from __future__ import annotations

from robust_metrics.dashboards.model import DashboardSpec, Needs, PanelSpec, Section, Target
from robust_metrics.dashboards.queries import ALERTS, NODES, RANKS, RI, increase, on_nodes
from robust_metrics.dashboards.styles import bars, stacked

NODE_GPU_HEALTH = DashboardSpec(
    uid="robust-node-gpu-health",
    file="node-gpu-health.json",
    title="Node and GPU health",
    description="GPUs, NICs and the sidecar of the nodes a run uses, from the node sidecar.",
    annotations=(ALERTS,),
    sections=(
        Section("GPU", (
            PanelSpec("GPU utilisation", "timeseries",
                      (Target(f"robust_gpu_utilization_ratio{{{NODES}}}", "{{node}} gpu {{gpu}}"),),
                      "Fraction of time a kernel ran. A GPU idling while its peers are busy is "
                      "waiting for a straggler or for data.", unit="percentunit", width=8,
                      needs=Needs.GPU),
            PanelSpec("GPU memory used", "timeseries",
                      (Target(f"robust_gpu_memory_used_bytes{{{NODES}}} / "
                              f"robust_gpu_memory_total_bytes{{{NODES}}}", "{{node}} gpu {{gpu}}"),),
                      "GPU memory in use over total.", unit="percentunit", width=8, needs=Needs.GPU),
            PanelSpec("GPU temperature", "timeseries",
                      (Target(f"robust_gpu_temperature_celsius{{{NODES}}}", "{{node}} gpu {{gpu}}"),),
                      "Core temperature; thermal throttling usually starts in the mid 80s.",
                      unit="celsius", width=8, needs=Needs.GPU),
            PanelSpec("GPU power", "timeseries",
                      (Target(f"robust_gpu_power_watts{{{NODES}}}", "{{node}} gpu {{gpu}}"),),
                      "Power draw. One GPU drawing much less than its peers under the same "
                      "work is throttled or starved.", unit="watt", width=8, needs=Needs.GPU),
            PanelSpec("GPU clocks", "timeseries", (
                Target(f"robust_gpu_sm_clock_hertz{{{NODES}}}", "SM {{node}} gpu {{gpu}}"),
                Target(f"robust_gpu_memory_clock_hertz{{{NODES}}}", "memory {{node}} gpu {{gpu}}"),
            ), "SM and memory clocks; a drop without a drop in load is throttling.",
               unit="hertz", width=8, needs=Needs.GPU),
            PanelSpec("Clock throttle reasons", "timeseries",
                      (Target(f"sum by (node, gpu, reason) (robust_gpu_clock_throttle{{{NODES}}})",
                              "{{node}} gpu {{gpu}} {{reason}}"),),
                      "1 while a clock-throttle reason is active. hw_slowdown and sw_thermal slow "
                      "the whole job down to this GPU's pace.", width=8, needs=Needs.GPU,
                      style=stacked),
        )),
        Section("GPU errors", (
            PanelSpec("XID events", "timeseries",
                      (Target(f"sum by (node, gpu, xid) "
                              f"{increase(f'robust_gpu_xid_errors_total{{{NODES}}}')}",
                              "{{node}} gpu {{gpu}} xid {{xid}}"),),
                      "Driver XID events (48: double-bit ECC, 79: fallen off the bus, 94/95: "
                      "contained/uncontained ECC). Series exist only once an XID occurred.",
                      width=8, needs=Needs.GPU_FAULT, style=bars),
            PanelSpec("ECC errors", "timeseries",
                      (Target(f"sum by (node, gpu, type) "
                              f"{increase(f'robust_gpu_ecc_errors_total{{{NODES}}}')}",
                              "{{node}} gpu {{gpu}} {{type}}"),),
                      "ECC errors by type. Uncorrected errors crash the job; a rising corrected "
                      "count announces them.", width=8, needs=Needs.GPU, style=bars),
            PanelSpec("Row remaps, PCIe replays, lost GPUs", "timeseries", (
                Target(f"robust_gpu_row_remap_pending{{{NODES}}}", "remap pending {{node}} gpu {{gpu}}"),
                Target(f"robust_gpu_row_remap_failure{{{NODES}}}", "remap failed {{node}} gpu {{gpu}}"),
                Target(f"increase(robust_gpu_pcie_replays_total{{{NODES}}}[{RI}])",
                       "PCIe replays {{node}} gpu {{gpu}}"),
                Target(f"robust_gpu_lost{{{NODES}}}", "lost {{node}} gpu {{gpu}}"),
            ), "A pending remap needs a GPU reset, a failed remap a new GPU, a lost GPU fell off "
               "the bus. All zero on a healthy node.", width=8, needs=Needs.GPU),
        )),
        Section("Network", (
            PanelSpec("NIC throughput", "timeseries", (
                Target(f"rate(robust_nic_transmit_bytes_total{{{NODES}}}[{RI}])",
                       "tx {{node}} {{device}}/{{port}}"),
                Target(f"rate(robust_nic_receive_bytes_total{{{NODES}}}[{RI}])",
                       "rx {{node}} {{device}}/{{port}}"),
            ), "Bytes per second through each InfiniBand/RoCE port.", unit="Bps", width=8,
               needs=Needs.NIC),
            PanelSpec("NIC port errors", "timeseries",
                      (Target(f"sum by (node, device, port, counter) (increase("
                              f"robust_nic_port_errors_total{{{NODES}}}[{RI}]))",
                              "{{node}} {{device}}/{{port}} {{counter}}"),),
                      "Port error counters (symbol errors, link downed, receive errors).",
                      width=8, needs=Needs.NIC, style=bars),
            PanelSpec("Link flaps and ports down", "timeseries", (
                Target(f"increase(robust_netdev_carrier_changes_total{{{NODES}}}[{RI}])",
                       "carrier changes {{node}} {{interface}}"),
                Target(f"1 - robust_nic_port_up{{{NODES}}}", "port down {{node}} {{device}}/{{port}}"),
            ), "Carrier changes of network devices and InfiniBand ports not ACTIVE. A flapping "
               "link stalls every collective that crosses it.", width=8, needs=Needs.NIC),
        )),
        Section("Self-test", (
            PanelSpec("Self-test verdicts", "timeseries",
                      (Target(f"min by (node, check) (robust_selftest_passed{{{NODES}}})",
                              "{{node}} {{check}}"),),
                      "1 when the check passed in the node's last self-test, 0 when it failed "
                      "(NodeSelftestFailed drains the node); no series for a skipped check.",
                      width=8, needs=Needs.SELFTEST),
            PanelSpec("Self-test compute throughput", "timeseries",
                      (Target(f"robust_selftest_compute_flops{{{NODES}}}", "{{node}}"),),
                      "FLOP/s of the seeded matrix multiply of each node's last self-test; a "
                      "node far below its peers is slow silicon.", unit="flops", width=8,
                      needs=Needs.SELFTEST),
            PanelSpec("Self-test bus bandwidth", "timeseries",
                      (Target(f"robust_selftest_bus_bandwidth_bytes_per_second{{{NODES}}}",
                              "{{node}}"),),
                      "All-reduce bus bandwidth of each node's last communication check.",
                      unit="Bps", width=8, needs=Needs.SELFTEST),
        )),
        Section("Sidecar and rank processes", (
            PanelSpec("Sidecar collector success", "timeseries",
                      (Target("min by (instance, collector) (robust_sidecar_collector_success)",
                              "{{instance}} {{collector}}"),),
                      "1 when the collector succeeded in the last scrape. A failing collector "
                      "costs its own series, not the scrape.", width=8, needs=Needs.SIDECAR),
            PanelSpec("Rank processes alive", "timeseries",
                      (Target(on_nodes(f"robust_rank_process_alive{{{RANKS}}}"),
                              "rank {{rank}} ({{node}})"),),
                      "1 while the rank's process exists, seen from the sidecar.", width=8,
                      needs=Needs.SIDECAR),
            PanelSpec("Rank process memory", "timeseries",
                      (Target(on_nodes(f"robust_rank_process_resident_memory_bytes{{{RANKS}}}"),
                              "rank {{rank}} ({{node}})"),),
                      "Resident memory of each rank process; a steady climb is a host memory "
                      "leak heading for the OOM killer.", unit="bytes", width=8, needs=Needs.SIDECAR),
        )),
    ),
)
