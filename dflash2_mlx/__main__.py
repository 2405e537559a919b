from dflash2_mlx.cli.app import main

main()
