"""PopART's DeviceManager and DeviceInfo, and a PopXL Session run on a device of the user's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipuxl
from ipuxl.device.device_info import (
    DeviceConnectionType, DeviceInfo, DeviceManager, DeviceSelectionCriterion, DeviceType, SyncPattern,
)
from ipuxl.errors import DeviceError, InvalidValueError, PopartException


def _doubling_program(replicas: int = 1):
    """w <- 2 * w, output w (after the update)."""
    ir = ipuxl.Ir(replication=replicas)
    with ir.main_graph:
        w = ipuxl.variable(np.arange(4, dtype=np.float32), name="w")
        ipuxl.ops.var_updates.copy_var_update_(w, w * 2)
        out = ipuxl.d2h_stream(w.shape, w.dtype, "out")
        ipuxl.ops.host_store(out, w)
    return ir, w, out


def test_enums_have_popart_members_and_values():
    assert [(m.name, m.value) for m in DeviceType] == [
        ("IpuModel", 0), ("Cpu", 1), ("Ipu", 2), ("OfflineIpu", 3), ("Sim", 4)]
    assert [m.name for m in DeviceSelectionCriterion] == ["First", "Random"]
    assert [m.name for m in DeviceConnectionType] == ["Always", "OnDemand", "Never"]


def test_the_compat_popart_module_names_the_device_api():
    import ipuxl.popart_compat as popart  # what `import popart` gives under ipuxl.compat

    assert popart.DeviceManager is DeviceManager and popart.DeviceInfo is DeviceInfo
    assert popart.DeviceSelectionCriterion.Random == DeviceSelectionCriterion.Random
    assert popart.SyncPattern is SyncPattern


def test_created_devices_describe_what_was_asked():
    dm = DeviceManager()
    cpu = dm.createCpuDevice()
    assert (cpu.type, cpu.numIpus, cpu.isAttached) == (DeviceType.Cpu, 1, False)
    model = dm.createIpuModelDevice({"numIPUs": 4, "tilesPerIPU": 4})
    assert (model.type, model.numIpus, model.tilesPerIPU, model.tilesPerIpu) == (DeviceType.IpuModel, 4, 4, 4)
    assert dm.createSimDevice({"numIPUs": 2}).type == DeviceType.Sim
    offline = dm.createOfflineIPUDevice({"numIPUs": 2})
    assert offline.type == DeviceType.OfflineIpu and offline.attach() is False


def test_acquire_attaches_with_always_and_holds_the_ipus_until_detached(monkeypatch):
    monkeypatch.setenv("IPUXL_NUM_IPUS", "2")
    dm = DeviceManager()
    a = dm.acquireAvailableDevice(2)  # connectionType defaults to Always: attached
    assert a is not None and a.isAttached and a.numIpus == 2 and a.type == DeviceType.Ipu
    assert dm.acquireAvailableDevice(1) is None  # both IPUs are held by `a`
    with a:
        pass  # leaving the context detaches, as PopART's DeviceInfo
    assert not a.isAttached
    b = dm.acquireAvailableDevice(1)
    assert b is not None and b.id == 0 and b.driverIds == [0]
    c = dm.acquireAvailableDevice(1, selectionCriterion=DeviceSelectionCriterion.First)
    assert c is not None and c.id == 1
    b.detach(), c.detach()


def test_on_demand_devices_are_not_attached_and_ids_follow_the_group_size(monkeypatch):
    monkeypatch.setenv("IPUXL_NUM_IPUS", "4")
    dm = DeviceManager()
    device = dm.acquireAvailableDevice(2, connectionType=DeviceConnectionType.OnDemand)
    assert device is not None and not device.isAttached
    assert [d.id for d in dm.enumerateDevices(numIpus=2)] == [4, 5]  # after the 4 single-IPU devices
    assert dm.acquireDeviceById(5, connectionType=DeviceConnectionType.OnDemand).numIpus == 2
    assert dm.acquireAvailableDevice(8) is None  # more than the machine has


def test_acquire_refuses_what_popart_refuses():
    dm = DeviceManager()
    with pytest.raises(PopartException, match="must be a power of two"):
        dm.acquireAvailableDevice(3)
    with pytest.raises(PopartException, match="connectionType is DeviceConnectionType::Never"):
        dm.acquireAvailableDevice(1, connectionType=DeviceConnectionType.Never)


def test_session_on_a_user_device_attaches_and_detaches_it():
    ir, w, out = _doubling_program()
    device = DeviceManager().createIpuModelDevice({"numIPUs": 1})
    session = ipuxl.Session(ir, device)
    assert session.device_type == "ipu_model" and not session.is_attached
    with session:
        assert device.isAttached
        np.testing.assert_array_equal(session.run()[out], np.arange(4, dtype=np.float32) * 2)
    assert not device.isAttached and not session.is_attached
    np.testing.assert_array_equal(session.get_tensor_data(w), np.arange(4, dtype=np.float32) * 2)


def test_an_attached_device_attaches_the_session_at_once():
    ir, w, out = _doubling_program()
    device = DeviceManager().createCpuDevice()
    assert device.attach()
    session = ipuxl.Session(ir, device)
    assert session.is_attached  # no `with` needed: PopXL copies the weights to it at construction
    np.testing.assert_array_equal(session.run()[out], np.arange(4, dtype=np.float32) * 2)
    with session:  # already attached: the context leaves it attached
        pass
    assert device.isAttached
    device.detach()


def test_an_offline_device_is_swapped_for_hardware_while_the_session_runs():
    ir, w, out = _doubling_program()
    offline = DeviceManager().createOfflineIPUDevice({"numIPUs": 1})
    session = ipuxl.Session(ir, offline)
    assert session.device_type == "ipu_hw"
    with session:
        assert session.is_attached
        session.run()
    assert not session.is_attached
    with session:  # the offline device was restored, and swapped again
        session.run()
    torch.testing.assert_close(torch.from_numpy(session.get_tensor_data(w)), torch.arange(4.0) * 4)


def test_a_device_with_too_few_ipus_is_refused(monkeypatch):
    ir, _, _ = _doubling_program(replicas=2)
    with pytest.raises(InvalidValueError, match="has 1 IPU.* needs 2"):
        ipuxl.Session(ir, DeviceManager().createIpuModelDevice({"numIPUs": 1}))


def test_a_session_cannot_attach_to_ipus_another_device_holds(monkeypatch):
    monkeypatch.setenv("IPUXL_NUM_IPUS", "1")
    dm = DeviceManager()
    holder = dm.acquireAvailableDevice(1)
    device = dm.acquireDeviceById(0, connectionType=DeviceConnectionType.OnDemand)
    ir, _, _ = _doubling_program()
    session = ipuxl.Session(ir, device)
    with pytest.raises(DeviceError, match="Could not attach to device 0"):
        with session:
            pass
    holder.detach()
    with session:
        session.run()


def test_sessions_from_a_device_name_attach_side_by_side():
    first, second = (ipuxl.Session(_doubling_program()[0], "ipu_hw") for _ in range(2))
    with first, second:
        assert first.is_attached and second.is_attached
