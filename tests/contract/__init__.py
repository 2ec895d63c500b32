"""The driver contract suite: one set of checks every VM driver (vmm.driver.VMDriver) passes."""
