from tpuft_operator.cli import main

main()
